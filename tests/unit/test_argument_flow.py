"""The launcher's argument flow visits each room once where it can: the functions that take
the command line (a parameter named ``argv``), and those that take Megatron-LM's arguments
(``args``) too, from ``cli.main`` through the dry run, the checks and the parse, traced in
order (``sys.setprofile``); a return to a room the flow has already left is counted. A room
is one job of the package, its top-level part (:func:`room`): the launch layer (``training``),
the loop plug-in (``loop``), the models, the data, ... The goal is at most 4 returns.
Following ``argv`` alone, the flow also returns to a module at most 4 times; following
``args`` too, it returns to a module 10 times (the rule modules run in two passes, problems
then notes), held as a ceiling that may only go down (21 before the launch record held the
checkpoint to resume, the data settings and the given flags, read once)."""

from __future__ import annotations

import contextlib
import io
import sys

from tests.unit.test_dry_run import SMALL

GOAL = 4
#: Returns to a module following ``argv`` and ``args`` (2026-12-06); lower it as the flow
#: improves.
ARGS_CEILING = 10


def room(module: str) -> str:
    """The room of a package module: its part of the package (``training``: the launch layer;
    ``loop``, ``models``, ``data``, ``runtime``, ``superposition``, ...)."""
    return module.split(".")[1]


def in_rooms(flow) -> list[tuple[str, str]]:
    """``flow`` by :func:`room`, consecutive calls in one room counted once."""
    rooms = []
    for module, function in flow:
        if not rooms or rooms[-1][0] != room(module):
            rooms.append((room(module), function))
    return rooms


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


def test_following_args_too_the_flow_returns_to_a_room_at_most_four_times(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    flow = _argv_flow(SMALL + ["--dry-run"], names=("argv", "args"))
    assert ("tst_megatron.loop.plan", "run_plan") in flow  # args were followed
    rooms = in_rooms(flow)
    assert {name for name, _ in rooms} >= {"training", "loop", "models", "data"}
    assert returns(rooms) <= GOAL, flow
    assert returns(flow) <= ARGS_CEILING, flow


def test_the_rooms_are_the_package_s_jobs():
    assert room("tst_megatron.training.checks.model") == "training"
    assert room("tst_megatron.training.dry_run") == "training"
    assert room("tst_megatron.loop.plan") == "loop"
    assert room("tst_megatron.models.pattern") == "models"
    assert room("tst_megatron.data.resume") == "data"


def test_the_count_sees_a_return():
    flow = [("a", "f"), ("b", "g"), ("a", "h"), ("c", "i"), ("b", "j")]
    assert returns(flow) == 2
    rooms = [
        (room(m), f)
        for m, f in [
            ("tst_megatron.training.cli", "main"),
            ("tst_megatron.models.pattern", "p"),
            ("tst_megatron.training.checks.data", "d"),
        ]
    ]
    assert returns(rooms) == 1  # fmt: skip


def test_a_dry_run_reads_the_checkpoint_to_resume_the_data_settings_and_the_flags_once(
    monkeypatch,
):
    """The launch record holds them (``Launch.resumed``, ``Launch.data``, ``Launch.given``):
    no rule reads them again."""
    monkeypatch.setenv("WORLD_SIZE", "1")
    counted = ("checkpoint_to_resume", "data_settings", "given")
    calls = {name: 0 for name in counted}

    def profile(frame, event, arg):
        if event == "call" and frame.f_globals.get("__name__", "").startswith("tst_megatron"):
            if frame.f_code.co_name in calls:
                calls[frame.f_code.co_name] += 1

    from tst_megatron.training import cli

    sys.setprofile(profile)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            cli.main(SMALL + ["--dry-run"])
    except SystemExit as exc:
        assert exc.code == 0
    finally:
        sys.setprofile(None)
    assert calls == {name: 1 for name in counted}, calls
