"""The Qwen3.5 vision tower and the 3-axis mRoPE positions match transformers' Qwen3_5 reference
(Qwen3_5VisionModel, Qwen3_5Model.get_rope_index) at small random configs."""

from __future__ import annotations

import pytest
import torch

from ninfer.models.mrope import MediaSpan, decode_positions, media_spans, mrope_positions
from ninfer.models.vision import VisionTower, vision_config_from_hf

transformers = pytest.importorskip("transformers")
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf_qwen  # noqa: E402
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5Config, Qwen3_5VisionConfig  # noqa: E402

SMALL_VISION = dict(depth=2, hidden_size=64, num_heads=4, intermediate_size=96, out_hidden_size=32,
                    num_position_embeddings=64)  # an 8x8 learned grid: the test grids resample it up and down
# two images of different sizes and one 2-frame video; the video's frames share the first image's size,
# so one attention group gathers frames from different items
GRIDS = [(1, 4, 6), (1, 10, 4), (2, 6, 4)]


def _hf_tower(seed: int = 0, **overrides):
    torch.manual_seed(seed)
    cfg = Qwen3_5VisionConfig(**(SMALL_VISION | overrides))
    cfg._attn_implementation = "sdpa"
    hf = hf_qwen.Qwen3_5VisionModel(cfg).eval()
    with torch.no_grad():  # larger than the 0.02 init, so every layer moves the output
        for name, p in hf.named_parameters():
            p.normal_(0.0, 0.3 if p.dim() > 1 else 0.1)
            if "norm" in name and name.endswith("weight"):
                p.add_(1.0)
    return hf, cfg


def _ours_from(hf, cfg) -> VisionTower:
    ours = VisionTower(vision_config_from_hf({"vision_config": cfg.to_dict()})).eval()
    ours.load_state_dict(hf.state_dict(), strict=True)
    return ours


def _patches(grids, dim: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(sum(t * h * w for t, h, w in grids), dim, generator=g)


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest deviation as a fraction of the reference's largest magnitude."""
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


def test_state_dict_names_match_the_checkpoint_layout():
    hf, cfg = _hf_tower()
    ours = VisionTower(vision_config_from_hf({"vision_config": cfg.to_dict()}))
    assert {k: tuple(v.shape) for k, v in ours.state_dict().items()} == \
        {k: tuple(v.shape) for k, v in hf.state_dict().items()}


@pytest.mark.parametrize("grids", [GRIDS, [(1, 4, 4)], [(3, 2, 4)]], ids=["mixed", "one-image", "video-only"])
def test_tower_matches_transformers_fp32(grids):
    hf, cfg = _hf_tower()
    ours = _ours_from(hf, cfg)
    patches = _patches(grids, ours.config.patch_dim)
    grid_thw = torch.tensor(grids)
    with torch.no_grad():
        want = hf(patches, grid_thw=grid_thw).pooler_output
        got = ours(patches, grid_thw)
    assert got.shape == (sum(ours.num_tokens(grids)), 32)
    # fp32 rounding only: the patch embedding alone (a matmul here, a conv3d there) differs by ~1e-6
    # of its magnitude, and the outputs are O(50) at these weight scales
    assert _relative_error(got, want) < 5e-6


def test_tower_matches_transformers_bf16():
    hf, cfg = _hf_tower()
    ours = _ours_from(hf, cfg)
    hf, ours = hf.to(torch.bfloat16), ours.to(torch.bfloat16)
    patches = _patches(GRIDS, ours.config.patch_dim)
    with torch.no_grad():
        want = hf(patches, grid_thw=torch.tensor(GRIDS)).pooler_output.float()
        got = ours(patches, torch.tensor(GRIDS)).float()
    assert _relative_error(got, want) < 0.03  # a few bf16 roundings (eps 2**-8) through two blocks


def test_items_do_not_attend_to_each_other():
    """Each item's embeddings are what it gets alone: attention stays inside a frame."""
    hf, cfg = _hf_tower()
    ours = _ours_from(hf, cfg)
    patches = _patches(GRIDS, ours.config.patch_dim)
    with torch.no_grad():
        together = ours(patches, GRIDS)
        alone, row = [], 0
        for t, h, w in GRIDS:
            alone.append(ours(patches[row:row + t * h * w], [(t, h, w)]))
            row += t * h * w
    torch.testing.assert_close(together, torch.cat(alone), atol=1e-5, rtol=1e-5)


def test_tower_rejects_patches_that_do_not_fit_the_grid():
    hf, cfg = _hf_tower()
    ours = _ours_from(hf, cfg)
    with pytest.raises(ValueError, match="do not match grid_thw"):
        ours(torch.zeros(10, ours.config.patch_dim), [(1, 4, 4)])
    with pytest.raises(ValueError, match="multiples of 2"):
        ours(torch.zeros(12, ours.config.patch_dim), [(1, 3, 4)])


# ---------------------------------------------------------------------------------------------
# mRoPE positions

IMAGE, VIDEO, START, END = 90, 91, 92, 93


def _hf_rope_index(token_ids, image_grids, video_grids):
    """transformers' Qwen3_5Model.get_rope_index on the token sequence."""
    text = dict(vocab_size=128, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                head_dim=16, intermediate_size=32, linear_num_key_heads=1, linear_num_value_heads=1,
                linear_key_head_dim=8, linear_value_head_dim=8, layer_types=["full_attention"])
    config = Qwen3_5Config(text_config=text, vision_config=dict(depth=1, hidden_size=32, num_heads=2,
                                                                intermediate_size=32, out_hidden_size=32),
                           image_token_id=IMAGE, video_token_id=VIDEO)
    model = hf_qwen.Qwen3_5Model(config)
    ids = torch.tensor([token_ids])
    types = torch.zeros_like(ids, dtype=torch.int32)
    types[ids == IMAGE], types[ids == VIDEO] = 1, 2
    positions, delta = model.get_rope_index(
        ids, types, image_grid_thw=torch.tensor(image_grids) if image_grids else None,
        video_grid_thw=torch.tensor(video_grids) if video_grids else None)
    return positions[:, 0], int(delta)


def _prompt():
    """text, image (1,4,6), text, image (1,10,4), timestamp text, video frame 0, timestamp text,
    video frame 1 (video grid (2,6,4): 6 tokens per frame), text: as the Qwen3.5 template lays it out."""
    ids = [1, 2, 3, START] + [IMAGE] * 6 + [END, 4, 5, START] + [IMAGE] * 10 + [END, 6, 7]
    ids += [START] + [VIDEO] * 6 + [END, 8, 9, START] + [VIDEO] * 6 + [END, 10, 11, 12]
    return ids, [(1, 4, 6), (1, 10, 4)], [(2, 6, 4)]


def test_mrope_positions_match_transformers_get_rope_index():
    ids, images, videos = _prompt()
    spans = media_spans(ids, images, videos, image_token_id=IMAGE, video_token_id=VIDEO)
    assert [(s.start, s.grid_thw, s.kind) for s in spans] == [
        (4, (1, 4, 6), "image"), (14, (1, 10, 4), "image"), (28, (1, 6, 4), "video"), (38, (1, 6, 4), "video")]
    ours = mrope_positions(len(ids), spans)
    want, delta = _hf_rope_index(ids, images, videos)
    assert torch.equal(ours.positions, want)
    assert ours.next_position == int(want.max()) + 1 == len(ids) + delta


def test_contiguous_video_span_is_its_frames_one_after_another():
    """A t=2 span given whole equals its two frames given as separate spans back to back."""
    whole = mrope_positions(20, [MediaSpan(3, (2, 4, 6), "video")])
    split = mrope_positions(20, [MediaSpan(3, (1, 4, 6), "video"), MediaSpan(9, (1, 4, 6), "video")])
    assert torch.equal(whole.positions, split.positions) and whole.next_position == split.next_position


def test_text_only_positions_are_the_degenerate_case():
    got = mrope_positions(7, [])
    assert torch.equal(got.positions, torch.arange(7).expand(3, 7)) and got.next_position == 7
    ids, images, videos = _prompt()
    tail = decode_positions(mrope_positions(len(ids), media_spans(ids, images, videos, IMAGE, VIDEO)).next_position, 3)
    assert torch.equal(tail, (torch.arange(3) + tail[0, 0]).expand(3, 3))


def test_media_spans_reject_mismatched_grids():
    ids, images, videos = _prompt()
    with pytest.raises(ValueError, match="placeholder"):
        media_spans(ids, [(1, 4, 4)] + images[1:], videos, IMAGE, VIDEO)
    with pytest.raises(ValueError, match="overlap|beyond"):
        mrope_positions(10, [MediaSpan(2, (1, 4, 4)), MediaSpan(4, (1, 4, 4))])
