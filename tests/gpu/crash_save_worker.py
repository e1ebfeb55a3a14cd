"""pretrain_gpt.py, killed with SIGKILL (its checkpoint writer processes with it) at one point
of its save of one iteration (tests/save_kill_points.py names the points). It kills its whole
process group: start it in a session of its own.

    python crash_save_worker.py POINT ITERATION -- <pretrain_gpt.py args>
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: save_kill_points


def main():
    import save_kill_points
    from megatron.moe_patches.driver.cli import pretrain_main

    split = sys.argv.index("--")
    point, iteration = sys.argv[1], int(sys.argv[2])
    save_kill_points.install(point, iteration)
    pretrain_main(sys.argv[split + 1:], prog="pretrain_gpt.py")  # as pretrain_gpt.py runs
    sys.exit(f"crash_save_worker: the run ended without reaching the kill point {point} at iteration {iteration}")


if __name__ == "__main__":  # megatron-core's save starts a process that re-imports this file
    main()
