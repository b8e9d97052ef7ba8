"""GRPO's loss against TRL's GRPOTrainer (`trl` in the test extras) on the same policy, completions, advantages,
old and reference log-probs: each loss type, with beta 0 and 0.1 (the KL with and without TRL's ratio
correction). The loss, and the gradients of the weights (the global norm, which no layout change of a weight
alters, and the output matrix, element by element), in fp32."""

import pytest
import torch

from ember.finetune.grpo_loss import policy_loss, token_logprobs

pytestmark = pytest.mark.slow

B, P, C = 4, 3, 5  # completions, prompt and completion lengths


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny random Llama and a word-level tokenizer, as an HF directory both TRL and ember load."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(64)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, eos_token="t1", pad_token="t2", unk_token="t0")
    tokenizer.save_pretrained(path)
    return path


def _grad_norm(model: torch.nn.Module) -> float:
    return torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters() if p.grad is not None)).item()


@pytest.mark.parametrize("loss_type, beta, correction", [
    ("grpo", 0.0, True), ("grpo", 0.1, True), ("grpo", 0.1, False), ("bnpo", 0.1, True), ("dr_grpo", 0.0, True),
    ("dr_grpo", 0.1, True), ("dapo", 0.0, True), ("dapo", 0.1, False)])
def test_the_loss_and_its_gradients_equal_trls(hf_dir, tmp_path, loss_type, beta, correction):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from ember import load_model

    args = GRPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=B, num_generations=2,
                      max_completion_length=C, loss_type=loss_type, beta=beta, epsilon=0.2, epsilon_high=0.28,
                      use_bias_correction_kl=correction, report_to=[], use_cpu=True, bf16=False)
    trainer = GRPOTrainer(model=str(hf_dir), reward_funcs=lambda completions, **_: [0.0] * len(completions),
                          args=args, train_dataset=Dataset.from_dict({"prompt": ["t3 t4"] * B}))
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # (set by its training_step)
    g = torch.Generator().manual_seed(1)
    prompt, completion = torch.randint(3, 64, (B, P), generator=g), torch.randint(3, 64, (B, C), generator=g)
    mask = torch.ones(B, C, dtype=torch.long)
    mask[1, 3:], mask[3, 1:] = 0, 0  # completions that ended early
    advantages = torch.tensor([1.0, -0.5, 0.7, -1.2])
    with torch.no_grad():  # old and reference log-probs off the current ones: ratios away from 1, some clipped
        current = token_logprobs(trainer.model(torch.cat([prompt, completion], 1)).logits[:, P - 1:-1], completion)
    old, ref = current + 0.3 * torch.randn(B, C, generator=g), current + 0.2 * torch.randn(B, C, generator=g)
    inputs = dict(prompt_ids=prompt, prompt_mask=torch.ones_like(prompt), completion_ids=completion,
                  completion_mask=mask, advantages=advantages, old_per_token_logps=old, ref_per_token_logps=ref,
                  num_items_in_batch=mask.sum())
    expected = trainer._compute_loss(trainer.model, inputs)
    expected.backward()

    model = load_model(hf_dir).float().train()
    logprobs = token_logprobs(model(torch.cat([prompt, completion], 1))[:, P - 1:-1], completion)
    loss, stats = policy_loss(logprobs, old, advantages, mask, loss_type=loss_type, clip_low=0.2, clip_high=0.28,
                              beta=beta, ref_logprobs=ref, kl_ratio_correction=correction, max_completion_length=C,
                              token_count=mask.sum().float())
    loss.backward()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6, abs=1e-7)
    assert _grad_norm(model) == pytest.approx(_grad_norm(trainer.model), rel=1e-5)
    theirs, ours = trainer.model.lm_head.weight.grad, dict(model.named_parameters())["output.weight"].grad
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)
    assert 0 < stats["clipped_low"] + stats["clipped_high"] < 1  # the clip was exercised
