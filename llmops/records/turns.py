"""Chat turns as records hold them: a prompt (text, or turns ending with a user turn) and its answer (text, or one
assistant turn), and the one exchange they make, as SFT renders a response.

Every conversational record kind and every objective that scores an exchange (SFT's instructions,
preference, feedback and reward pairs, GRPO's prompts and references) builds it here.
"""

from __future__ import annotations

from typing import Any

# chat turns, as the chat templates render them (not imported from there: a template edit would change the data
# stages' keys, which read conversations but never render one)
Messages = list[dict[str, Any]]


def prompt_messages(prompt: Any) -> Messages:
    """A string prompt is one user turn, as SFT's instruction is."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [{"role": turn["role"], "content": turn["content"]} for turn in prompt]


def answer_text(answer: Any) -> str:
    return answer if isinstance(answer, str) else answer[-1]["content"]


def conversation(prompt: Any, answer: Any) -> Messages:
    """A prompt (text, or chat turns ending with a user turn) and its answer (text, or one assistant turn), as SFT
    renders a response: the one exchange an instruction is, and the one every preference, feedback, reward and
    GRPO objective scores."""
    return prompt_messages(prompt) + [{"role": "assistant", "content": answer_text(answer)}]
