""".ci/run: the README's two set-up commands, with the Space's and the harness's extras installed, the
single-node Slurm cluster started and the lint run between them, in a copy."""

import os
import shutil
import subprocess

import pytest
from helpers import run_guarded

README = """# x
<!-- setup-commands -->
```bash
echo first-command >> "$LOG"; git rev-parse --is-inside-work-tree >> "$LOG"
echo python -m pytest -q tests >> "$LOG"
```
<!-- /setup-commands -->
"""


@pytest.mark.skipif(shutil.which("git") is None, reason=".ci/run lists the files to copy with git")
@pytest.mark.parametrize("torch_installed", [True, False])
def test_space_browser_and_harness_extras_are_installed_after_the_install_and_before_the_tests(
    repo_root, tmp_path, torch_installed
):
    repo = tmp_path / "repo"
    (repo / ".ci").mkdir(parents=True)
    shutil.copy(os.path.join(repo_root, ".ci", "run"), repo / ".ci" / "run")
    (repo / "README.md").write_text(README)
    (repo / "scripts" / "slurm").mkdir(parents=True)  # records that CI starts the single-node Slurm cluster
    (repo / "scripts" / "slurm" / "start_local_slurm.sh").write_text('echo "start slurm" >> "$LOG"\n')
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    shims = tmp_path / "bin"
    shims.mkdir()
    pip = shims / "pip"  # records what CI installs, and where
    pip.write_text('#!/usr/bin/env bash\necho "pip $* (in $(basename "$PWD"))" >> "$LOG"\n')
    pip.chmod(0o755)
    python = shims / "python"  # records the lint step, and says whether torch imports
    torch_exit = 0 if torch_installed else 1
    python.write_text(
        f'#!/usr/bin/env bash\nif [ "$1" = -c ]; then exit {torch_exit}; fi\necho "python $*" >> "$LOG"\n'
    )
    python.chmod(0o755)
    for name, script in (("chromium", "exit 0"), ("apt-get", 'echo "apt-get $*" >> "$LOG"')):
        shim = shims / name  # Chromium is there, so apt-get must not be called (the shim records it if it is)
        shim.write_text(f"#!/usr/bin/env bash\n{script}\n")
        shim.chmod(0o755)
    log = tmp_path / "log"
    env = dict(os.environ, PATH=f"{shims}{os.pathsep}{os.environ['PATH']}", LOG=str(log))
    done = run_guarded(["bash", str(repo / ".ci" / "run")], cwd=repo, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    lines = log.read_text().splitlines()
    # PyTorch's CPU wheel before the README's first command, only where no torch imports
    if not torch_installed:
        assert lines.pop(0).startswith("pip install torch==2.13.0 (in ")
    assert lines[0] == "first-command"
    assert lines.pop(1) == "true"  # the copy is a git work tree: tests and the Space's upload list files with git
    assert lines[1].startswith(
        "pip install -e .[space,browser,harness,corpus] (in tmp."
    )  # in the isolated copy, not the checkout
    assert lines[2] == "start slurm"  # the Slurm pipeline test needs it up
    assert lines[3:5] == ["python -m ruff format --check .", "python -m ruff check ."]
    assert lines[5] == "python -m pytest -q tests"
    assert len(lines) == 6
