"""Which blocks and edge units each stage holds, for even, uneven, looped and V layouts.

A tiny model written here keeps the plait model contract (a ModuleDict `layers` keyed "0".."n-1",
an embedding, norm and output head that may be None, `parallel_info()` plain data): splitting reads
only that data, so no model package is needed. The stages are chained by hand in one process and
must compute the unsplit model's output.
"""

import pytest
import torch
from torch import nn

from plait.pipelineparallel import split_stages, stage_blocks, stage_indices, stage_layer_counts

DIM, VOCAB = 8, 16


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ffn = nn.Linear(DIM, DIM)

    def forward(self, x, positions):
        return x + torch.tanh(self.ffn(x)) * positions[..., None]


class Tiny(nn.Module):
    def __init__(self, n_layers):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({str(i): Block() for i in range(n_layers)})
        self.norm = nn.LayerNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)
        self.register_buffer("scale", torch.tensor(0.5), persistent=False)  # root state every stage keeps

    def forward(self, tokens, positions=None, document_positions=None):
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        positions = positions if positions is not None else torch.arange(h.shape[1]) * self.scale
        for layer in self.layers.values():
            h = layer(h, positions)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h

    def parallel_info(self):
        return {"blocks": [f"layers.{k}" for k in self.layers], "edge_units": [["tok_embeddings"], ["norm", "output"]]}


def _holds(stage):
    m = stage.module
    return (
        m.tok_embeddings is not None,
        sorted(m.layers.keys(), key=int),
        m.norm is not None and m.output is not None,
    )


def test_even_split_two_stages():
    model = Tiny(4)
    stages = [split_stages(model, model.parallel_info(), 2, r)[0] for r in range(2)]
    assert [s.index for s in stages] == [0, 1] and stages[0].is_first and stages[1].is_last
    assert _holds(stages[0]) == (True, ["0", "1"], False)
    assert _holds(stages[1]) == (False, ["2", "3"], True)
    assert stages[0].blocks == ["layers.0", "layers.1"] and stages[1].edge_units == [["norm", "output"]]
    assert len(model.layers) == 4 and model.output is not None  # the model itself is left whole


def test_uneven_layers_per_stage_and_edge_only_stages():
    model = Tiny(4)
    info = model.parallel_info()
    stages = [s for r in range(2) for s in split_stages(model, info, 2, r, [0, 2, 2, 0], 2, "v")]
    by_index = {s.index: s for s in stages}
    assert [s.index for s in stages] == [0, 3, 1, 2]  # V: rank 0 holds stages 0 and 3, rank 1 holds 1 and 2
    assert _holds(by_index[0]) == (True, [], False)
    assert _holds(by_index[1]) == (False, ["0", "1"], False)
    assert _holds(by_index[2]) == (False, ["2", "3"], False)
    assert _holds(by_index[3]) == (False, [], True)
    three = split_stages(model, info, 2, 1, [1, 3])[0]
    assert _holds(three) == (False, ["1", "2", "3"], True)


def test_loop_placement_for_interleaved_schedules():
    assert stage_indices(0, 4, 2, "loop") == [0, 4] and stage_indices(3, 4, 2, "loop") == [3, 7]
    assert stage_indices(0, 4, 2, "v") == [0, 7] and stage_indices(3, 4, 2, "v") == [3, 4]
    model = Tiny(8)
    stages = split_stages(model, model.parallel_info(), 2, 1, virtual_stages=2)
    assert [(s.index, s.blocks) for s in stages] == [(1, ["layers.2", "layers.3"]), (3, ["layers.6", "layers.7"])]
    assert _holds(stages[1])[2] and not _holds(stages[0])[0]


def test_chained_stages_compute_the_whole_model():
    torch.manual_seed(0)
    model = Tiny(5)
    tokens = torch.randint(0, VOCAB, (2, 6))
    positions = torch.rand(2, 6)
    stages = sorted(
        (s for r in range(3) for s in split_stages(model, model.parallel_info(), 3, r, [1, 3, 1])), key=lambda s: s.index
    )
    h = tokens
    for stage in stages:
        h = stage.module(h, positions=positions)
    torch.testing.assert_close(h, model(tokens, positions=positions), rtol=0, atol=0)
    # State-dict keys are the unsplit model's, partitioned over the stages.
    keys = [k for s in stages for k in s.module.state_dict()]
    assert sorted(keys) == sorted(model.state_dict()) and len(keys) == len(set(keys))


def test_counts_and_blocks_helpers():
    assert stage_layer_counts(8, 4) == [2, 2, 2, 2]
    assert stage_layer_counts(8, 2, [3, 5]) == [3, 5]
    assert stage_blocks(["a", "b", "c"], [1, 0, 2]) == [["a"], [], ["b", "c"]]
    with pytest.raises(ValueError, match="parallelism.layers_per_stage"):
        stage_layer_counts(7, 2)


def test_blocks_in_a_module_list_are_refused():
    model = nn.Module()
    model.layers = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])
    info = {"blocks": ["layers.0", "layers.1"], "edge_units": []}
    with pytest.raises(TypeError, match="nn.ModuleDict"):
        split_stages(model, info, 2, 0)


def test_a_block_the_model_lacks_is_named():
    """A blocks (or edge_units) entry the model lacks: one line naming it (it passed validation,
    then split_stages raised AttributeError; issue 40 fault probe 15)."""
    from plait.pipelineparallel.config import PipelineConfigError

    model = Tiny(4)
    info = model.parallel_info()
    with pytest.raises(PipelineConfigError, match=r"'blocks'\] names 'layer.3', which is not a submodule of Tiny"):
        split_stages(model, dict(info, blocks=["layers.0", "layers.1", "layers.2", "layer.3"]), 2, 0)
    with pytest.raises(PipelineConfigError, match=r"'edge_units'\] names 'head'"):
        split_stages(model, dict(info, edge_units=[["tok_embeddings"], ["norm", "head"]]), 2, 0)
