"""Does the upstream TensorWrapper crash happen on this torch? Plain redirection of a freshly compiled Liger DPO loss with an
unfrozen reference head inside DDP.forward ("Cannot access storage of TensorWrapper"), on 2 CPU ranks.

Exit 0: it crashes (tests/test_route_ddp.py's fallback tests have their premise); 2: it does not, and plain
redirection is exact; 1: neither. Used by .ci/compat.
"""

import sys

from wrapperroute.check.cell import Cell, run_cell
from wrapperroute.ranks import RankPool

if __name__ == "__main__":
    with RankPool(2) as pool:
        ranks = pool.run(run_cell, Cell(loss="liger_dpo", mode="redirect", fresh_compile=True))
    crash = all("Cannot access storage of TensorWrapper" in (rank.error or "") for rank in ranks)
    exact = all(r.error is None and r.differ == 0 and r.max_ref_diff <= 1e-6 for r in ranks)
    said = "reproduces" if crash else f"does not reproduce (plain redirection exact: {exact})"
    print(f"the upstream TensorWrapper crash {said} on this torch", file=sys.stderr)
    sys.exit(0 if crash else 2 if exact else 1)
