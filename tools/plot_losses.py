"""Plot training and validation loss (with the TST switch) from a --tensorboard-dir.

python tools/plot_losses.py --tensorboard-dir runs/quickstart/tensorboard --output runs/quickstart/loss.png
"""

import argparse
import sys

from tst_megatron.plots import plot_losses


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tensorboard-dir", required=True)
    p.add_argument("--output", required=True, help="PNG file")
    p.add_argument("--title", default="TST pretraining")
    args = p.parse_args()
    try:
        print(f"wrote {plot_losses(args.tensorboard_dir, args.output, title=args.title)}")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
