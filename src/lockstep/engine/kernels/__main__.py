"""`python -m lockstep.engine.kernels`: build the fused CPU kernels (scripts/setup.sh runs this)."""

import sys

from lockstep.engine import kernels


def main() -> int:
    try:
        path = kernels.build(verbose="-v" in sys.argv)
    except Exception as e:  # noqa: BLE001 - no compiler, no headers: say so, the fallback still works
        print(f"lockstep: the fused kernels could not be built ({type(e).__name__}: {str(e)[-2000:]}); the forward "
              f"will run on the pure-PyTorch path. Install g++ and re-run: {sys.executable} -m lockstep.engine.kernels",
              file=sys.stderr)
        return 1
    print(f"lockstep: fused kernels built: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
