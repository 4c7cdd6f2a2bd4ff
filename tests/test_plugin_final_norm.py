"""LNPlacement stops a fit it can't finish correctly: without an example input, a stack whose final norm can't be
determined (Hugging Face's Wav2Vec2 in its post-norm configuration, whose forward can be neither run on made-up
inputs nor traced) would be left pre-norm with perhaps no final norm. The error names `example_input_array`,
the model is left as it was, and with the input set the same fit converts it completely."""

from __future__ import annotations

import copy

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from torch.utils.data import DataLoader, TensorDataset

from ln_lightning import PlacementError
from ln_lightning.plugin import LNPlacement

T = pytest.importorskip("transformers")
T.logging.set_verbosity_error()

W2V = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, conv_dim=(16, 16), conv_stride=(2, 2),
           conv_kernel=(3, 3), num_conv_pos_embeddings=4, num_conv_pos_embedding_groups=2, hidden_dropout=0.0,
           attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0, layerdrop=0.0, mask_time_prob=0.0)


class Speech(LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.model = T.Wav2Vec2Model(T.Wav2Vec2Config(**W2V, do_stable_layer_norm=False))

    def forward(self, x):
        return self.model(x).last_hidden_state

    def training_step(self, batch, batch_idx):
        return self(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(4, 200, generator=torch.Generator().manual_seed(1))), batch_size=2)


def _fit(tmp_path, module):
    plugin = LNPlacement("pre", fused=False)
    Trainer(accelerator="cpu", devices=1, max_steps=1, plugins=[plugin], enable_progress_bar=False, enable_model_summary=False,
            logger=False, enable_checkpointing=False, default_root_dir=str(tmp_path)).fit(module)
    return plugin


def test_fit_without_example_input_array_stops_naming_it_and_leaves_the_model(tmp_path):
    module = Speech()
    before = copy.deepcopy(module.state_dict())
    x = torch.randn(2, 200, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        y0 = module.eval()(x)
    with pytest.raises(PlacementError, match=r"example_input_array") as err:
        _fit(tmp_path, module)
    assert "model.encoder.layers" in str(err.value) and "final norm" in str(err.value)
    assert module.state_dict().keys() == before.keys()
    assert all(torch.equal(module.state_dict()[k], v) for k, v in before.items())
    with torch.no_grad():
        torch.testing.assert_close(module.eval()(x), y0, atol=0, rtol=0)  # still post-norm: nothing was rewritten


def test_fit_with_example_input_array_converts_completely(tmp_path):
    module = Speech()
    module.example_input_array = torch.randn(2, 200, generator=torch.Generator().manual_seed(2))
    plugin = _fit(tmp_path, module)
    assert plugin.report.complete and plugin.report.added == ["model.encoder.layers_final_norm"], str(plugin.report)
