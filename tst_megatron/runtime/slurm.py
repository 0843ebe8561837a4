"""Slurm glue for the launcher: hostlist expansion and the rendezvous address of a job step.

A process started by ``srun`` (one task per GPU, no torchrun) learns its rank from
``SLURM_PROCID``, but nobody exports ``MASTER_ADDR``/``MASTER_PORT`` for it. Every task of
a step can compute the same answer from the step's environment: the first host of
``SLURM_STEP_NODELIST`` (where task 0 runs under Slurm's default block distribution) and a
port derived from ``SLURM_JOB_ID`` (so two jobs sharing a node do not collide). Slurm writes
node lists compressed (``node[01-03,07],gpu-a[1-2]``); :func:`expand_hostlist` expands them
the way ``scontrol show hostnames`` does, without needing the Slurm binaries on the node.
"""

from __future__ import annotations

import itertools
import re
from typing import Mapping, Optional

#: Ports derived from a job id: ``PORT_BASE + job_id % PORT_SPAN``. Below Linux's default
#: ephemeral range (32768-60999), above the well-known/registered ports most daemons use.
PORT_BASE, PORT_SPAN = 10000, 20000

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def _split_top_level(text: str, hostlist: str) -> list[str]:
    """Split at commas outside brackets; raise on unbalanced brackets."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"bad Slurm hostlist {hostlist!r}: nested '['")
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"bad Slurm hostlist {hostlist!r}: ']' without '['")
        elif char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError(f"bad Slurm hostlist {hostlist!r}: '[' without ']'")
    parts.append(text[start:])
    return parts


def _expand_brackets(inner: str, hostlist: str) -> list[str]:
    """``01-03,07`` -> ``['01', '02', '03', '07']`` (zero padding kept from the lower bound)."""
    out = []
    for item in inner.split(","):
        match = _RANGE.match(item.strip())
        if not match:
            raise ValueError(f"bad Slurm hostlist {hostlist!r}: range {item!r} is not N or N-M")
        lo_text, hi_text = match.group(1), match.group(2)
        lo, hi = int(lo_text), int(hi_text if hi_text is not None else lo_text)
        if hi < lo:
            raise ValueError(f"bad Slurm hostlist {hostlist!r}: range {item!r} runs backwards")
        width = len(lo_text) if lo_text.startswith("0") else 0
        out += [str(n).zfill(width) for n in range(lo, hi + 1)]
    return out


def expand_hostlist(hostlist: str) -> list[str]:
    """Expand a Slurm hostlist into host names, in order, as ``scontrol show hostnames`` does.

    ``"node[01-03,07],login"`` -> ``["node01", "node02", "node03", "node07", "login"]``;
    several bracket groups in one name expand as a product
    (``"r[1-2]n[1-2]"`` -> ``r1n1, r1n2, r2n1, r2n2``). Zero padding follows the lower bound
    (``[08-10]`` -> ``08, 09, 10``). Duplicates are kept.

    Raises:
        ValueError: empty list, unbalanced or nested brackets, or a range that is not
            ``N`` / ``N-M`` with ``N <= M`` (one line, quoting the input).
    """
    if not hostlist or not hostlist.strip():
        raise ValueError("bad Slurm hostlist '': it is empty")
    hosts = []
    for part in _split_top_level(hostlist.strip(), hostlist):
        if not part:
            raise ValueError(f"bad Slurm hostlist {hostlist!r}: empty name between commas")
        pieces = re.split(r"\[([^\]]*)\]", part)  # text, inner, text, inner, ..., text
        choices = [
            [piece] if i % 2 == 0 else _expand_brackets(piece, hostlist)
            for i, piece in enumerate(pieces)
        ]
        hosts += ["".join(combo) for combo in itertools.product(*choices)]
    return hosts


def in_srun_step(env: Mapping[str, str]) -> bool:
    """True inside a task started by ``srun`` (a job step); False in the batch script itself.

    The batch script also sees ``SLURM_PROCID=0`` and the job's ``SLURM_NTASKS``, but it is a
    single process: only ``srun`` tasks carry a step id.
    """
    return "SLURM_PROCID" in env and ("SLURM_STEP_ID" in env or "SLURM_STEPID" in env)


def slurm_rendezvous(env: Mapping[str, str]) -> tuple[str, int]:
    """``(MASTER_ADDR, MASTER_PORT)`` for the tasks of one ``srun`` step.

    Address: the first host of ``SLURM_STEP_NODELIST`` (else ``SLURM_JOB_NODELIST``). Port:
    ``PORT_BASE + SLURM_JOB_ID % PORT_SPAN`` (else 29500). Values exported by the batch
    script (``MASTER_ADDR``, ``MASTER_PORT``) win.

    Raises:
        ValueError: no node list in ``env`` (not inside a Slurm job), or a malformed one.
    """
    nodelist: Optional[str] = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
    addr = env.get("MASTER_ADDR")
    if addr is None:
        if not nodelist:
            raise ValueError(
                "started by srun but neither SLURM_STEP_NODELIST nor SLURM_JOB_NODELIST is set; "
                "export MASTER_ADDR"
            )
        addr = expand_hostlist(nodelist)[0]
    if "MASTER_PORT" in env:
        port = int(env["MASTER_PORT"])
    elif "SLURM_JOB_ID" in env:
        port = PORT_BASE + int(env["SLURM_JOB_ID"]) % PORT_SPAN
    else:
        port = 29500
    return addr, port
