"""model.compile: each transformer layer compiled on its own, equal to eager and break-free.

Inductor on CPU fuses elementwise ops and may reorder float sums, so compiled and eager agree to
about 1e-6 relative, not bitwise; 1e-5 leaves room for that and nothing more.
"""

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from megatron.models.document_mask import document_mask
from megatron.models.transformer import TransformerLayer
from megatron.parallel.random import RNGTracker
from tests.model_config import tiny_model_config
from tests.test_document_mask import CPU, packed_batch
from tests.test_gpt_model import batch, build
from tests.test_layers import close


@pytest.mark.parametrize("documents", [False, True])
def test_the_training_layer_has_no_graph_break(documents):
    """Training without dropout (no RNG fork, no KV cache) traces to one graph, causal or with
    the additive document mask."""
    tracker = RNGTracker(CPU.device)
    tracker.seed(0, 0)
    layer = TransformerLayer(tiny_model_config(), CPU, tracker, 0).train()
    _, _, _, docs = packed_batch()
    mask = document_mask(docs, torch.float32, flex=False) if documents else None
    x = torch.randn(docs.shape[0], docs.shape[1], 32, requires_grad=True)
    explained = torch._dynamo.explain(layer)(x, mask)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1


@pytest.mark.slow
@pytest.mark.timeout(90)  # cold compile: ~30 s on 2 busy cores
def test_compiled_layers_equal_eager():
    """A 2-layer GPT, compiled per layer, against the same weights in eager: logits, loss and
    every gradient; decoding with a KV cache runs the eager layers (no recompiles)."""
    torch._dynamo.reset()
    counters.clear()
    _, eager, _ = build(1, st=CPU)
    _, compiled, _ = build(1, st=CPU, compile=True)
    compiled.load_state_dict(eager.state_dict())
    tokens, labels = batch()
    results = []
    for model in (eager, compiled):
        logits = model(tokens)
        loss = model(tokens, labels=labels).mean()
        loss.backward()
        results.append((logits.detach(), loss.detach(), dict(model.named_parameters())))
    # Both layers ran one shared compiled graph (regional compilation compiles the code once).
    assert counters["stats"]["unique_graphs"] == 1
    (ref_logits, ref_loss, ref_params), (logits, loss, params) = results
    close(logits, ref_logits, 1e-5)
    close(loss, ref_loss, 1e-5)
    for name, p in params.items():
        close(p.grad, ref_params[name].grad, 1e-5)
    cache = compiled.new_kv_cache(tokens.shape[0], tokens.shape[1])
    with torch.no_grad():
        close(compiled(tokens, kv_cache=cache), ref_logits, 1e-5)
    assert counters["stats"]["unique_graphs"] == 1
