"""The launcher's argument flow visits each module once where it can: the functions that take
the command line (a parameter named ``argv``), and those that take Megatron-LM's arguments
(``args``) too, from ``cli.main`` through the dry run, the checks and the parse, traced in
order (``sys.setprofile``); a return to a module the flow has already left is counted. The
goal is at most 4 for both; following ``args`` the flow returns 21 times today (each rule
module reads the checkpoint to resume, the data settings or the command line again), so that
count is held as a ceiling that may only go down."""

from __future__ import annotations

import contextlib
import io
import sys

from tests.unit.test_dry_run import SMALL

GOAL = 4
#: Returns following ``argv`` and ``args`` (2026-12-06); lower it as the flow improves.
ARGS_CEILING = 21


def _argv_flow(argv, names=("argv",)) -> list[tuple[str, str]]:
    """``[(module, function)]`` of the package's calls that take a parameter of ``names``, in
    call order, consecutive calls in one module counted once."""
    from tst_megatron.training import cli

    flow = []

    def profile(frame, event, arg):
        if event != "call":
            return
        module = frame.f_globals.get("__name__", "")
        code = frame.f_code
        params = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
        if module.startswith("tst_megatron") and set(names) & set(params):
            if not flow or flow[-1][0] != module:
                flow.append((module, code.co_name))

    out = io.StringIO()
    sys.setprofile(profile)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            cli.main(argv)
    except SystemExit as exc:
        assert exc.code == 0, out.getvalue()
    finally:
        sys.setprofile(None)
    return flow


def returns(flow) -> int:
    """How many entries of ``flow`` come back to a module it has left before."""
    seen, count = set(), 0
    for module, _ in flow:
        count += module in seen
        seen.add(module)
    return count


def test_the_argument_flow_returns_to_a_module_at_most_four_times(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    flow = _argv_flow(SMALL + ["--dry-run"])
    assert flow[0] == ("tst_megatron.training.cli", "main")
    assert ("tst_megatron.training.validate", "check") in flow  # the flow was traced
    assert returns(flow) <= GOAL, flow


def test_following_args_too_the_flow_returns_no_more_often_than_before(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    flow = _argv_flow(SMALL + ["--dry-run"], names=("argv", "args"))
    assert ("tst_megatron.training.plan", "run_plan") in flow  # args were followed
    assert returns(flow) <= ARGS_CEILING, flow


def test_the_count_sees_a_return():
    flow = [("a", "f"), ("b", "g"), ("a", "h"), ("c", "i"), ("b", "j")]
    assert returns(flow) == 2
