"""What the command line checks before LightningCLI parses, and how it rewords the parser's errors.

Every bad input ends in one line that says what is wrong and how to fix it (README, "Bad input:
one line each"). Here, as small pure functions:

* ``prepare_argv``: lets ``--model.lr -1e-5`` through as a value, and refuses the trainer settings
  that are linked from model settings (``trainer.max_epochs``, ``trainer.gradient_clip_val``),
  given as flags or in a ``--config`` file, whose YAML syntax it checks on the way;
* ``explain_parser_error``: turns jsonargparse's long messages (a reward ``class_path`` that does not
  import lists every member of the ``reward`` union, the real cause buried mid-line) into one
  short line naming the real cause;
* ``check_run_dir``: a run directory that cannot be created or written, refused before anything runs.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import os
import re
from pathlib import Path

from .config import GRPOConfigError

# Trainer settings that are set from a model setting (GRPOLightningCLI.add_arguments_to_parser); the
# parser rejects them as flags with "invalid Optional value" and silently overwrites them from YAML.
LINKED_SETTINGS = {
    "max_epochs": ("total_phases", "one epoch is one GRPO phase"),
    "gradient_clip_val": ("max_grad_norm", "the module clips gradients to max_grad_norm"),
}


# ---- argv ----------------------------------------------------------------------------------


def is_negative_number(token: str) -> bool:
    """``-1e-5``, ``-0.5``, ``-3``, ``-inf``: a value, not an option. (argparse only recognises
    ``-3`` and ``-0.5`` as numbers, so ``--model.lr -1e-5`` fails with "expected one argument".)"""
    if not token.startswith("-"):
        return False
    try:
        float(token)
    except ValueError:
        return False
    return True


def join_negative_values(argv: list[str]) -> list[str]:
    """``--opt -1e-5`` becomes ``--opt=-1e-5``, which argparse reads as the option's value."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        if token.startswith("--") and "=" not in token and i + 1 < len(argv) and is_negative_number(argv[i + 1]):
            out.append(f"{token}={argv[i + 1]}")
            i += 2
        else:
            out.append(token)
            i += 1
    return out


def _flag_value(argv: list[str], i: int) -> tuple[str, str | None]:
    """The option name and value of ``argv[i]`` (``--a=1`` or ``--a 1``)."""
    name, eq, value = argv[i].partition("=")
    if eq:
        return name, value
    return name, argv[i + 1] if i + 1 < len(argv) else None


def linked_setting_error(trainer_key: str, value, where: str | None = None) -> GRPOConfigError:
    """``where``: None for a flag, else the config file the key was found in."""
    model_key, why = LINKED_SETTINGS[trainer_key]
    shown = "" if value is None else f" {value}"
    if where is None:
        return GRPOConfigError(
            f"trainer.{trainer_key} is set by model.{model_key} ({why}): pass --model.{model_key}{shown} instead"
        )
    return GRPOConfigError(
        f"trainer.{trainer_key} (in {where}) is set by model.{model_key} ({why}): "
        f"write {model_key}:{shown} under model: instead"
    )


def config_files(argv: list[str]) -> list[str]:
    """The paths given to ``--config`` (either form)."""
    paths = []
    for i, token in enumerate(argv):
        if token == "--config" or token.startswith("--config="):
            value = _flag_value(argv, i)[1]
            if value is not None:
                paths.append(value)
    return paths


def check_config_file(path: str) -> None:
    """A config file's YAML syntax (with the file, line and column named) and linked trainer keys.
    A path that is no file is left to the parser (which says so)."""
    import yaml

    if not os.path.isfile(path):
        return
    try:
        with open(path, encoding="utf-8") as file:
            data = yaml.safe_load(file)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise GRPOConfigError(f"config {path}: YAML syntax error{at}: {problem}; fix the file") from error
    except (OSError, UnicodeDecodeError) as error:
        raise GRPOConfigError(f"config {path}: cannot be read ({error}); pass a readable YAML file") from error
    if not isinstance(data, dict):
        return
    for section in (data, data.get("fit")):  # `--config` after `fit`, or before it with a `fit:` block
        trainer = section.get("trainer") if isinstance(section, dict) else None
        if isinstance(trainer, dict):
            for key in LINKED_SETTINGS:
                if key in trainer:
                    raise linked_setting_error(key, trainer[key], where=path)


def prepare_argv(argv: list[str]) -> list[str]:
    """The arguments LightningCLI is given: negative numbers joined to their option, after refusing
    linked trainer settings and broken config files with one clear line."""
    argv = join_negative_values(list(argv))
    for i, token in enumerate(argv):
        name, value = _flag_value(argv, i) if token.startswith("--") else (token, None)
        key = name[len("--trainer.") :] if name.startswith("--trainer.") else None
        if key in LINKED_SETTINGS:
            raise linked_setting_error(key, value)
    for path in config_files(argv):
        check_config_file(path)
    return argv


# ---- parser messages -----------------------------------------------------------------------

_KEY = re.compile(r'^Parser key "([^"]+)": ')
_CLASS_PATH_PROBLEM = re.compile(r"Problem with given class_path '([^']+)': ")
# Where the first union member's error ends and the next member's begins.
_NEXT_MEMBER = re.compile(r" - (?:Type typing\.|Expected a <class '(?:NoneType|collections\.abc\.\w+|bool)'>)")
_EXPECTED_TYPE = re.compile(
    r"^(?:Parser key \"([^\"]+)\": )?(?:- Expected a path but .*? either not accessible or invalid - )?"
    r"Expected a <class '([\w.]+)'>\.? ?Got value: (.*)$"
)
_SUBTYPES = re.compile(r"Subtypes: \[(.*?)\] Errors:")
_GIVEN = re.compile(r"Given value: (.*)$")
_GIVEN_CLASS_PATH = re.compile(r"class_path'?(?:=|: )'([^']+)'")  # Namespace(class_path='x') or {'class_path': 'x'}
_NOT_SUBCLASS = re.compile(r"Import path (?:\S+ )?does not correspond to a subclass of (\w+)")
_IMPORT_FAILURES = ("has no attribute", "No module named", "cannot import name")


def _short_type(text: str) -> str:
    """``<class 'rewards.base.Reward'>`` -> ``Reward``; ``typing.Callable[...]`` -> ``a function``."""
    match = re.search(r"<class '([\w.]+)'>", text)
    if match:
        return match.group(1).rsplit(".", 1)[-1]
    return "a function" if "Callable" in text else text.strip()


def _subtypes(message: str) -> list[str]:
    match = _SUBTYPES.search(message)
    if not match:
        return []
    return [_short_type(part) for part in re.split(r", (?=<class|typing\.|collections\.)", match.group(1))]


def _init_parameters(class_path: str) -> list[str]:
    module_name, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), name)
        params = inspect.signature(cls.__init__).parameters
    except (ImportError, AttributeError, TypeError, ValueError):
        return []
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return [name for name, param in params.items() if name != "self" and param.kind not in variadic]


def _explain_class_path(key: str, class_path: str, cause: str, base: str) -> str:
    """One line for a ``class_path`` that failed, from its cause (nested class_paths: the innermost)."""
    inner = _CLASS_PATH_PROBLEM.search(cause)
    if inner:  # e.g. a WeightedSum whose component fails: name the component
        inner_key = _KEY.match(cause)
        where = f"{key} ({class_path} init_args.{inner_key.group(1)})" if inner_key else key
        return _explain_class_path(where, inner.group(1), cause[inner.end() :], base)
    example = ", e.g. rewards.CharCount" if base == "Reward" else ""
    if any(marker in cause for marker in _IMPORT_FAILURES):
        return f"{key}: cannot import '{class_path}' ({cause}); class_path must name a {base} subclass{example}"
    unknown = re.match(r"Option '([^']+)' is not accepted", cause)
    if unknown:
        accepted = _init_parameters(class_path)
        takes = f" (it takes: {', '.join(accepted)})" if accepted else ""
        return f"{key}: {class_path} has no init_arg '{unknown.group(1)}'{takes}"
    typed = _EXPECTED_TYPE.match(cause)
    if typed:
        arg, expected, got = typed.groups()
        return f"{key}: {class_path} init_args.{arg}: expected {expected.rsplit('.', 1)[-1]}, got {got}"
    return f"{key}: {class_path}: {cause}"


def explain_parser_error(message: str) -> str:
    """A one-line jsonargparse message, reworded where its real cause is buried; else unchanged."""
    key_match = _KEY.match(message)
    key = key_match.group(1) if key_match else None
    problem = _CLASS_PATH_PROBLEM.search(message)
    if key and problem:
        cause = message[problem.end() :]
        end = _NEXT_MEMBER.search(cause)
        subtypes = _subtypes(message)
        base = subtypes[0] if subtypes else "class"
        return _explain_class_path(key, problem.group(1), cause[: end.start()] if end else cause, base)
    if key and "Does not validate against any of the Union subtypes" in message:
        given = _GIVEN.search(message)
        value = given.group(1) if given else "?"
        class_path = _GIVEN_CLASS_PATH.search(value)
        value = class_path.group(1) if class_path else value
        not_subclass = _NOT_SUBCLASS.search(message)
        if not_subclass:
            base = not_subclass.group(1)
            example = " (or a reward function), e.g. rewards.CharCount" if base == "Reward" else ""
            return f"{key}: '{value}' is not a {base} subclass; class_path must name one{example}"
        if re.search(r"Expected an instantiatable class, but (?:\S+ )?is abstract", message):
            return f"{key}: '{value}' is abstract; name a subclass that implements it, e.g. rewards.CharCount"
        return f"{key}: got {value!r}, expected one of: {', '.join(_subtypes(message)) or 'see --help'}"
    typed = _EXPECTED_TYPE.match(message)
    if typed and typed.group(1):
        key, expected, got = typed.groups()
        return f"{key}: expected {expected.rsplit('.', 1)[-1]}, got {got}"
    missing = re.match(r"Parser key \"config\": File does not exist: '(.*)'$", message)
    if missing:
        return f"--config: no file at '{missing.group(1)}'; check the path"
    unknown = re.match(r"Subcommand '\w+' does not accept option '([\w.]+)'$", message) or re.match(
        r"unrecognized arguments: --([\w.]+)", message
    )
    if unknown:
        return message + suggest_setting(unknown.group(1))
    return message


def explain_instantiation_error(error: ValueError) -> str | None:
    """A class that the parser accepted but whose ``__init__`` raised (a user's reward, say): the
    parser reports it as an unmatched union; say which class raised what."""
    message = " ".join(str(error).split())
    if not message.startswith("Does not validate against any of the Union subtypes"):
        return None
    given = _GIVEN_CLASS_PATH.search(message)
    cause = error.__cause__
    if given is None or cause is None:
        return None
    text = str(cause).splitlines()[0] if str(cause) else ""
    return f"could not build {given.group(1)}: its __init__ raised {type(cause).__name__}: {text}"


def known_settings() -> list[str]:
    """``model.*`` and ``trainer.*`` setting names, for suggestions."""
    from lightning.pytorch import Trainer

    from .module import GRPOModule

    names = []
    for prefix, function in (("model", GRPOModule.__init__), ("trainer", Trainer.__init__)):
        names += [f"{prefix}.{name}" for name in inspect.signature(function).parameters if name != "self"]
    return names


def suggest_setting(name: str) -> str:
    """`` (did you mean model.batch_size?)`` for a misspelt setting, else ``""``."""
    close = difflib.get_close_matches(name, known_settings(), n=1, cutoff=0.8)
    return f" (did you mean {close[0]}?)" if close else ""


# ---- the run directory ---------------------------------------------------------------------


def run_dir_problem(path: str | os.PathLike) -> str | None:
    """Why ``path`` cannot be (created and) written, or None. Creates nothing: the run directory is
    only made once the run starts, so a refused run leaves no trace."""
    target = Path(path).expanduser().absolute()
    existing = target
    while not os.path.lexists(existing) and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        kind = "a file" if existing.is_file() else "not a directory"
        return f"'{existing}' is {kind}, so no directory can be made there"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"'{existing}' is not writable"
    return None


def check_run_dir(path: str | os.PathLike | None) -> None:
    if path is None:
        return
    problem = run_dir_problem(path)
    if problem:
        raise GRPOConfigError(
            f"trainer.default_root_dir: cannot write the run directory '{path}': {problem}; "
            "pass --trainer.default_root_dir a directory you can write to"
        )
