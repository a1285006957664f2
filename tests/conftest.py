"""Session-wide fixtures: one pool of 2 gloo ranks for every multi-rank test, one inductor cache for all."""

from __future__ import annotations

import os
import pathlib
from collections.abc import Iterator

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
CACHE = REPO / ".cache"
# Set before torch compiles anything, here and in the rank workers (they inherit os.environ).
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(CACHE / "inductor"))
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(CACHE / "torch_extensions"))
os.environ.setdefault("TRITON_CACHE_DIR", str(CACHE / "triton"))
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from wrapperroute.ranks import RankPool  # noqa: E402


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--long", action="store_true", help="draw many more examples in the property and sequence tests")


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--long"):
        os.environ["WRAPPERROUTE_LONG"] = "1"  # read by the test modules as they are imported, after this


WORLD_SIZE = 2


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """This process as the one rank of a gloo group, for a module's single-process tests of real wrappers."""
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="session")
def pool() -> Iterator[RankPool]:
    """Two gloo ranks, spawned once. A task that fails restarts them (see wrapperroute.ranks)."""
    ranks = RankPool(WORLD_SIZE)
    ranks.start()
    yield ranks
    ranks.close()


@pytest.fixture(scope="session")
def pool4() -> Iterator[RankPool]:
    """Four gloo ranks, spawned once, at the first test that needs them: the layouts that need 4 ranks to be what
    they are (HSDP, dp x tp, pp x dp)."""
    with RankPool(4) as ranks:
        yield ranks
