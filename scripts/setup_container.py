"""Install tst_megatron and megatron-core into this Python environment as it is (NVIDIA's
PyTorch container: torch, Transformer Engine and Apex built for each other), without replacing
any of its GPU stack. Run by ``scripts/setup.sh --container``; run it with the environment's
own interpreter.

How: the project and megatron-core are installed with ``--no-deps``; then their other
requirements (torch's dropped: it is here) under a pip constraints file that pins every
installed package of the GPU stack (:data:`KEEP`) to its installed version, so pip may add
packages but never replace those. Afterwards the pinned versions are compared with the ones
found before; a change is an error. Then one line per optional GPU package: found (version)
or not, and the flags it serves.

Exit status: 0 done; 1 no torch here, a torch older than megatron-core's, a pip failure, or a
kept package changed (one line).
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import os
import re
import subprocess
import sys
import tempfile

#: Distributions of the GPU stack this mode never replaces (canonical names; ``nvidia-*`` too).
KEEP = (
    "torch", "torchvision", "torchaudio", "triton", "numpy", "transformer-engine",
    "transformer-engine-torch", "transformer-engine-cu12", "transformer-engine-cu13", "apex",
    "flash-attn", "flash-attn-3", "grouped-gemm", "mamba-ssm", "causal-conv1d",
)  # fmt: skip

#: What each optional package serves: (import name, distribution names, the flags it enables).
OPTIONAL = {
    "Transformer Engine": (
        "transformer_engine",
        ("transformer-engine", "transformer-engine-torch"),
        "--transformer-impl transformer_engine (Megatron-LM's default), FP8 (--fp8-format), "
        "--moe-permute-fusion, fused RoPE",
    ),
    "Apex": (
        "fused_weight_gradient_mlp_cuda",
        ("apex",),
        "--gradient-accumulation-fusion's kernel (Megatron-LM's default on), fused Adam",
    ),
    "grouped_gemm": ("grouped_gemm", ("grouped-gemm",), "--moe-grouped-gemm without TE"),
    "flash_attn": ("flash_attn", ("flash-attn",), "--attention-backend flash"),
}

#: megatron-core 0.19's own torch requirement (its metadata), which the kept torch must meet.
TORCH_NEEDED = ">=2.6.0"

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def canonical(name: str) -> str:
    """PEP 503's normalised distribution name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def installed() -> dict:
    """``{canonical name: version}`` of every distribution importable here."""
    return {canonical(d.metadata["Name"]): d.version for d in md.distributions()}


def kept(versions: dict) -> dict:
    """The installed distributions of :data:`KEEP` (and every ``nvidia-*``), with versions."""
    return {n: v for n, v in versions.items() if n in KEEP or n.startswith("nvidia-")}


def requirements(dist: str, extras=()) -> list[str]:
    """``dist``'s requirements that apply here (markers evaluated for ``extras``), torch
    dropped."""
    try:
        from packaging.requirements import Requirement
    except ImportError:  # a bare environment: pip's own copy
        from pip._vendor.packaging.requirements import Requirement

    out = []
    for text in md.requires(dist) or []:
        req = Requirement(text)
        applies = not req.marker or any(
            req.marker.evaluate({"extra": extra}) for extra in (*extras, "")
        )
        if applies and canonical(req.name) != "torch":
            out.append(str(req).split(";")[0].strip())
    return out


def pip(*args: str) -> None:
    """``python -m pip install -q ARGS``; exits 1 with pip's last line on failure."""
    command = [sys.executable, "-m", "pip", "install", "-q", *args]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        last = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no output"]
        sys.exit(f"setup.sh --container: pip failed ({' '.join(args[:3])} ...): {last[0]}")


def main() -> None:
    before = installed()
    if "torch" not in before:
        sys.exit(
            "setup.sh --container: no torch in this environment ("
            + sys.executable
            + "): this mode keeps the environment's torch; run it inside NVIDIA's PyTorch "
            "container, or use scripts/setup.sh (a virtual environment)"
        )
    try:
        from packaging.specifiers import SpecifierSet
    except ImportError:  # a bare environment: pip's own copy
        from pip._vendor.packaging.specifiers import SpecifierSet
    if not SpecifierSet(TORCH_NEEDED).contains(before["torch"], prereleases=True):
        sys.exit(
            f"setup.sh --container: this environment's torch {before['torch']} is older than "
            f"megatron-core 0.19's {TORCH_NEEDED}: use a newer container (NVIDIA PyTorch 25.01 "
            "or later), or scripts/setup.sh (a virtual environment)"
        )
    pins = kept(before)
    megatron_core = os.environ.get("MEGATRON_CORE_SPEC") or "megatron-core>=0.19,<0.20"
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write("".join(f"{name}=={version}\n" for name, version in sorted(pins.items())))
        constraints = f.name
    try:
        pip("--no-deps", "-e", f"{ROOT}[hf]", megatron_core)
        wanted = requirements("tst-megatron", ("hf",)) + requirements("megatron-core")
        wanted = [r for r in wanted if canonical(re.split(r"[<>=!~; \[]", r)[0]) != "megatron-core"]
        pip("-c", constraints, *wanted)
    finally:
        os.unlink(constraints)
    after = installed()
    changed = [f"{n} {v} -> {after.get(n, 'gone')}" for n, v in pins.items() if after.get(n) != v]
    if changed:
        sys.exit(f"setup.sh --container: pip changed the GPU stack: {', '.join(changed)}")
    print(
        f"set up {sys.executable} in place: Python {sys.version.split()[0]}, torch "
        f"{after['torch']} (kept), megatron-core {after.get('megatron-core')}, tst-megatron "
        f"{after.get('tst-megatron')}"
    )
    for name, (module, dists, flags) in OPTIONAL.items():
        version = next((after[d] for d in dists if d in after), None)
        if importlib.util.find_spec(module) is not None:
            print(f"  {name}: found{f' ({version})' if version else ''}: {flags}")
        else:
            print(f"  {name}: not found: without it, {flags} are refused or fall back")


if __name__ == "__main__":
    main()
