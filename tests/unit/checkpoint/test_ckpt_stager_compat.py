"""The stager survives torch < 2.15's close-after-every-stage (seen on torch 2.11, H200).

Before torch 2.15, `DefaultStager._stage` closes its inner StateDictStager
after every stage, emptying its copier table, and the next stage of a state
dict holding a class object failed with `KeyError: <class 'type'>`: every
second pinned save. The test calls that per-stage close itself, as that torch
did, on the locked torch.
"""

import collections

import torch

from cairn.checkpoint import inflight


def _state() -> dict[str, object]:
    # An nn.Module state dict is an OrderedDict; its copy reaches a class object.
    return {"model": collections.OrderedDict(w=torch.arange(4.0)), "kind": torch.nn.Linear}


def test_a_second_stage_after_the_per_stage_close_of_older_torch_succeeds() -> None:
    stager = inflight.make_stager("thread", cuda=False)
    assert stager is not None
    try:
        for n in range(3):
            staged = inflight.stage(stager, _state()).result()
            assert torch.equal(staged["model"]["w"], torch.arange(4.0)), n
            stager._state_dict_stager.close()  # type: ignore[no-untyped-call]  # torch < 2.15, per stage
    finally:
        stager.close()


def test_closing_the_stager_closes_the_inner_stager_for_real() -> None:
    stager = inflight.make_stager("thread", cuda=False)
    assert stager is not None
    inflight.stage(stager, _state()).result()
    inner = stager._state_dict_stager
    assert inner._deepcopy_dispatch
    stager.close()
    assert not inner._deepcopy_dispatch and not inner._cached_storage_mapping
