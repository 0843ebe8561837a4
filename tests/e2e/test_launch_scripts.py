"""Issue 15: real Megatron-LM launch scripts pass ``--dry-run`` at their own world size with
only the script name changed, ``--tst-bag-size`` added and paths made local."""

import os
import subprocess
import sys

import pytest

from tests.e2e.launch_scripts import SCRIPTS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_launch_script_passes_the_dry_run(name):
    script = SCRIPTS[name]
    result = subprocess.run(
        [sys.executable, "examples/pretrain_gpt_tst.py", *script["argv"], "--dry-run"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "WORLD_SIZE": str(script["world_size"]), "RANK": "0"},
    )
    assert result.returncode == 0, result.stderr
    assert "dry run: no problems found" in result.stdout
    assert f"world {script['world_size']} = " in result.stdout
