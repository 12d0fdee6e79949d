"""The README's config reference is the schema's own (regenerate with the snippet below)."""

from pathlib import Path

from megatron.config.schema import config_reference

README = Path(__file__).resolve().parent.parent / "README.md"
START, END = "<!-- config-reference:start", "<!-- config-reference:end -->"


def embedded_reference(text: str) -> str:
    body = text.split(START, 1)[1].split(END, 1)[0]
    return body.split("-->", 1)[1].strip()


def test_readme_config_reference_is_current():
    """If this fails, run: python -c "import tests.test_readme as t; t.regenerate()"."""
    assert embedded_reference(README.read_text()) == config_reference()


def regenerate() -> None:
    text = README.read_text()
    head, rest = text.split(START, 1)
    marker, tail = rest.split(END, 1)
    marker = marker.split("-->", 1)[0] + "-->"
    README.write_text(f"{head}{START}{marker}\n{config_reference()}\n{END}{tail}")


def test_ci_runs_the_readme_test_command():
    """.ci/run is the README's test command (SLURM's guarded install included), nothing else."""
    ci = (README.parent / ".ci" / "run").read_text().splitlines()
    command = [line for line in ci if line and not line.startswith("#")][-1]
    assert command in README.read_text().splitlines()
    assert "pytest" in command and "slurm-wlm munge" in command
