"""The model zoo under FSDP x TP on a 2x2 (dp, tp) mesh: each Hugging Face model's TP plan
(with and without sequence parallelism) over "tp", then ``fully_shard`` on every block
and the root over "dp"; each dp row trains on its half of the batch. Losses, first
gradients and parameters match one process over several AdamW steps."""
import copy

import pytest

from helpers import assert_all_ranks
from mpidtensor import DTensor
from zoo_models import ZOO, check_trains_like_one_process, fully_shard_zoo


@pytest.mark.parametrize("plan", ["tp", "tp+sp"])
@pytest.mark.parametrize("name", list(ZOO))
def test_fsdp_tp_trains_like_one_process(name, plan, mesh2d):
    zoo = ZOO[name]
    parallelize = zoo.tensor_parallel if plan == "tp" else zoo.sequence_parallel
    if isinstance(parallelize, str):
        pytest.skip(f"{name}: {parallelize}")
    ref = zoo.build()
    model = copy.deepcopy(ref)
    parallelize(model, mesh2d["tp"])
    fully_shard_zoo(model, zoo, mesh2d["dp"])
    on_2d = [p.device_mesh == mesh2d for p in model.parameters() if isinstance(p, DTensor)]
    assert_all_ranks(any(on_2d), "no parameter is sharded over both dp and tp")
    dp = mesh2d.get_group("dp")
    check_trains_like_one_process(model, ref, zoo.batches(), dp.rank, dp.size, dp)
