"""Data for RL post-training: grain pipelines of prompts with verifiable rewards.

    from sparserl_jax.data import DataConfig, prompt_iterator, make_reward_fn, compute_rewards

    cfg = DataConfig(task="arithmetic", batch_size=8, seed=0)
    it = prompt_iterator(cfg)
    batch = next(it)                                   # PromptBatch: prompts + answers
    reward = make_reward_fn(cfg)
    r = compute_rewards(reward, batch.examples, completions, group_size=G)   # [B * G]
    state = it.get_state()                             # -> checkpoint; resume with state=...

Tasks: `arithmetic` (scratchpad completions), `countdown`, `gsm8k` (JSONL/Parquet files), and
any of them with a user reward function given as `reward_fn="package.module:function"`.
"""

from sparserl_jax.data.arithmetic import arithmetic_reward, make_arithmetic_example, solve
from sparserl_jax.data.config import (
    OPERATORS,
    TASKS,
    ArithmeticConfig,
    CountdownConfig,
    DataConfig,
)
from sparserl_jax.data.countdown import (
    ExpressionError,
    countdown_reward,
    make_countdown_example,
)
from sparserl_jax.data.countdown import evaluate as evaluate_expression
from sparserl_jax.data.countdown import parse as parse_expression
from sparserl_jax.data.extract import (
    extract_gold_number,
    extract_predicted_number,
    format_number,
    last_answer_line,
    last_boxed,
    last_number,
    parse_number,
)
from sparserl_jax.data.files import load_file_examples
from sparserl_jax.data.pipeline import (
    PromptLimit,
    SFTBatch,
    encode_prompts,
    eval_examples,
    example_source,
    iterator_state,
    prompt_dataset,
    prompt_iterator,
    resume_iterator,
    sft_batch,
    sft_pairs,
)
from sparserl_jax.data.records import DataError, Example, LoadReport, PromptBatch
from sparserl_jax.data.rewards import (
    RewardError,
    RewardFn,
    compute_rewards,
    gsm8k_reward,
    load_reward_fn,
    make_reward_fn,
    task_reward,
    try_reward_fn,
)

__all__ = [
    "OPERATORS",
    "TASKS",
    "ArithmeticConfig",
    "CountdownConfig",
    "DataConfig",
    "DataError",
    "Example",
    "ExpressionError",
    "LoadReport",
    "PromptBatch",
    "RewardError",
    "RewardFn",
    "SFTBatch",
    "arithmetic_reward",
    "compute_rewards",
    "countdown_reward",
    "encode_prompts",
    "eval_examples",
    "evaluate_expression",
    "example_source",
    "extract_gold_number",
    "extract_predicted_number",
    "format_number",
    "gsm8k_reward",
    "last_answer_line",
    "last_boxed",
    "last_number",
    "load_file_examples",
    "load_reward_fn",
    "make_arithmetic_example",
    "make_countdown_example",
    "make_reward_fn",
    "parse_expression",
    "parse_number",
    "prompt_dataset",
    "prompt_iterator",
    "PromptLimit",
    "iterator_state",
    "resume_iterator",
    "sft_batch",
    "sft_pairs",
    "solve",
    "task_reward",
    "try_reward_fn",
]
