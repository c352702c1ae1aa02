"""The README's Python examples run as printed."""

import re

from conftest import ROOT


def readme_example(name):
    text = (ROOT / "README.md").read_text()
    match = re.search(rf"<!-- python-example: {name} -->\n```python\n(.*?)```", text, re.S)
    assert match, f"README.md has no python example `{name}`"
    return match.group(1)


def test_the_compare_example_runs_and_passes(capsys):
    exec(compile(readme_example("compare"), "README.md (compare)", "exec"), {})
    printed = capsys.readouterr().out
    assert "blockwise_mm (given outputs) vs reference" in printed
    assert "PASS: 1 of 1 output tensors within tolerance" in printed
