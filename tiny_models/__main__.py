"""CLI: python -m tiny_models --arch ARCH --preset PRESET --out DIR [--seed N] | --default"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from .build import DEFAULT_ARCH, DEFAULT_PRESET, DEFAULT_SEED, MODEL_FILE, default_model_dir, make
from .spec import ARCHS, PRESETS
from .weights import param_split, read_shapes


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tiny_models", description=__doc__)
    parser.add_argument(
        "--default", action="store_true", help=f"make the model `make up` serves, in {default_model_dir()}"
    )
    parser.add_argument("--arch", choices=ARCHS)
    parser.add_argument("--preset", choices=PRESETS, default="tiny")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.default:
        if args.arch or args.out:
            parser.error("--default takes no --arch/--out")
        args.arch, args.preset, args.seed = DEFAULT_ARCH, DEFAULT_PRESET, DEFAULT_SEED
        args.out = default_model_dir()
    elif not (args.arch and args.out):
        parser.error("--arch and --out are required (or use --default)")
    return args


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = _parse(argv)
    path = make(args.arch, args.out, preset=args.preset, seed=args.seed)
    logging.getLogger("tiny_models").info("%s", param_split(read_shapes(path / MODEL_FILE)).describe())
    print(path)


if __name__ == "__main__":
    main()
