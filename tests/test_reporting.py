"""The phase line and the sample table (console and TensorBoard Markdown)."""

from __future__ import annotations

from html.parser import HTMLParser

import pytest
import torch

from grpo_lightning.reporting import (
    SampleRow,
    display_text,
    escape_markdown_cell,
    phase_line,
    render_console_table,
    render_markdown_table,
    sample_table_rows,
)
from grpo_lightning.rollout_stats import select_sample_indices



def test_phase_line():
    assert phase_line(3, 20, 1.5, 0.25) == "Phase 003/020, Mean reward: 1.5000, KL: 0.2500"
    assert phase_line(1, 2, 0.0, None) == "Phase 001/002, Mean reward: 0.0000, KL: n/a (no reference model at kl_coef=0)"


def test_console_never_reads_sample_as_rich_markup():
    # "[/]" used to raise rich's MarkupError, and "[bold]" vanished from the table.
    rows = sample_table_rows(["x [/] y [bold]z[/bold]"], torch.tensor([1.0]), torch.tensor([0.0]), None, [0])
    assert "x [/] y [bold]z[/bold]" in render_console_table(rows, width=80)


# ---- sample_table_rows and the table -------------------------------------------------------


SAMPLES = ["first", "two\nlines", "pipe | here", "last"]
REWARDS = torch.tensor([1.0, 3.0, -2.0, 0.5])
ADVANTAGES = torch.tensor([0.125, 1.5, -1.25, -0.375])
REF_PER_TOKEN = torch.tensor([[-1.0, -1.5], [-0.25, -0.25], [-4.0, -6.0], [0.0, -0.125]])


def test_sample_table_rows_in_given_order_with_summed_ref():
    rows = sample_table_rows(SAMPLES, REWARDS, ADVANTAGES, REF_PER_TOKEN, [1, 3, 2])
    assert rows == [
        SampleRow(3.0, -0.5, "two\nlines", advantage=1.5),
        SampleRow(0.5, -0.125, "last", advantage=-0.375),
        SampleRow(-2.0, -10.0, "pipe | here", advantage=-1.25),
    ]
    # A ref already summed per sample, (B,), gives the same rows.
    assert sample_table_rows(SAMPLES, REWARDS, ADVANTAGES, REF_PER_TOKEN.sum(-1), [1, 3, 2]) == rows
    assert sample_table_rows(SAMPLES, REWARDS, ADVANTAGES, None, []) == []


def test_sample_table_rows_validates():
    with pytest.raises(ValueError, match="rewards and advantages"):
        sample_table_rows(SAMPLES, REWARDS[:3], ADVANTAGES, None, [0])
    with pytest.raises(ValueError, match="rewards and advantages"):
        sample_table_rows(SAMPLES, REWARDS, ADVANTAGES[:2], None, [0])
    with pytest.raises(ValueError, match="ref_logprobs"):
        sample_table_rows(SAMPLES, REWARDS, ADVANTAGES, REF_PER_TOKEN[:3], [0])
    with pytest.raises(IndexError):
        sample_table_rows(SAMPLES, REWARDS, ADVANTAGES, None, [4])
    with pytest.raises(IndexError):
        sample_table_rows(SAMPLES, REWARDS, ADVANTAGES, None, [-1])


def test_wide_markdown_table_exact():
    rows = sample_table_rows(SAMPLES, REWARDS, ADVANTAGES, REF_PER_TOKEN, select_sample_indices(REWARDS, 3))
    assert render_markdown_table(rows) == (
        "| Reward | Advantage | Ref log-prob | Sample |\n"
        "|---:|---:|---:|---|\n"
        "| 3 | +1.500 | -0.50 | two⏎lines |\n"
        "| 1 | +0.125 | -2.50 | first |\n"
        "| -2 | -1.250 | -10.00 | pipe \\| here |"
    )


def test_wide_tables_without_reference_show_dash():
    rows = sample_table_rows(SAMPLES, REWARDS, ADVANTAGES, None, [0])
    assert render_markdown_table(rows).splitlines()[2] == "| 1 | +0.125 | – | first |"
    out = render_console_table(rows, width=70)
    header = out.splitlines()[1]
    assert [c.strip() for c in header.split("┃")[1:5]] == ["Reward", "Advantage", "Ref log-prob", "Sample"]
    assert [c.strip() for c in out.splitlines()[3].split("│")[1:5]] == ["1", "+0.125", "–", "first"]


def test_wide_console_table_one_line_per_sample():
    rows = sample_table_rows(SAMPLES, REWARDS, ADVANTAGES, REF_PER_TOKEN, [1, 2])
    out = render_console_table(rows, width=70)
    assert "│      3 │    +1.500 │        -0.50 │ two⏎lines" in out
    assert "│     -2 │    -1.250 │       -10.00 │ pipe | here" in out


# ---- Markdown escaping, checked against TensorBoard's own renderer ------------------------------


def test_display_text_line_breaks():
    assert display_text("a\nb\r\nc\rd") == "a⏎b⏎c⏎d"


def test_escape_markdown_cell_exact():
    assert escape_markdown_cell("a|b\nc") == "a\\|b⏎c"
    assert escape_markdown_cell("x\\|y") == "x\\\\\\|y"
    assert escape_markdown_cell("**b** _i_ `c` [l](u)") == "\\*\\*b\\*\\* \\_i\\_ \\`c\\` \\[l\\](u)"
    assert escape_markdown_cell("<i>&amp;</i>") == "&lt;i&gt;&amp;amp;&lt;/i&gt;"


class _Cells(HTMLParser):
    """The text of each <td>, entities decoded."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.cells: list[str] = []
        self._in_td = False

    def handle_starttag(self, tag, attrs):
        if tag == "td":
            self._in_td = True
            self.cells.append("")
        elif self._in_td:
            self.cells[-1] += f"<{tag}>"  # any markup inside a cell is a failure to escape

    def handle_endtag(self, tag):
        if tag == "td":
            self._in_td = False
        elif self._in_td:
            self.cells[-1] += f"</{tag}>"

    def handle_data(self, data):
        if self._in_td:
            self.cells[-1] += data


NASTY = [
    "a | b",
    "x\\|y and a trailing backslash \\",
    "`code | with pipe` and ``double``",
    "**bold** __strong__ *em* _em_ snake_case_name",
    "<script>alert(1)</script> <b>not bold</b> a < b > c",
    "&lt; is an entity, &amp; too, & alone",
    "[link](http://example.com) ![img](x.png)",
    "line one\nline two\r\n- not a list\n# not a heading",
    "[/] [bold]rich markup[/bold]",
]


def test_markdown_cells_render_literally_in_tensorboard():
    plugin_util = pytest.importorskip("tensorboard.plugin_util")
    rewards = torch.arange(len(NASTY), dtype=torch.float32)
    rows = sample_table_rows(NASTY, rewards, torch.zeros(len(NASTY)), None, list(range(len(NASTY))))
    parser = _Cells()
    parser.feed(plugin_util.markdown_to_safe_html(render_markdown_table(rows)))
    cells = parser.cells
    assert len(cells) == 4 * len(NASTY)  # no cell split or merged by a stray pipe
    shown = [cells[4 * i + 3] for i in range(len(NASTY))]  # entities already decoded by the parser
    # Markdown trims a cell and HTML does not keep runs of spaces; none of these samples depends on either.
    assert shown == [display_text(text) for text in NASTY]
