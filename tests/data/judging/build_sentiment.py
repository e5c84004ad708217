"""Writes sentiment.jsonl: short product and place reviews with their gold sentiment, as few-shot prompts for
`genscore calibrate` (a task SmolLM2-135M does well above chance, with the mistakes negations bring)."""

from __future__ import annotations

import json
from pathlib import Path

SHOTS = ("Review: I loved every minute of it.\nSentiment: positive\n"
         "Review: A boring waste of time.\nSentiment: negative\n")
SUBJECTS = ["The pasta", "This phone", "The hotel room", "The movie", "The concert", "This book", "The service",
            "The laptop", "This jacket", "The museum tour"]
PHRASES = {
    "positive": ["was excellent", "exceeded my expectations", "was a joy", "felt worth every penny",
                 "was charming and well made", "made my day", "was not bad at all", "never disappointed me",
                 "was not what I feared, it was great"],
    "negative": ["was a disappointment", "fell apart quickly", "was overpriced and bland", "left me annoyed",
                 "was a waste of money", "was noisy and dirty", "was not good", "never worked properly",
                 "was not what I hoped for"],
}


def main() -> None:
    lines = []
    for subject in SUBJECTS:
        for label, phrases in PHRASES.items():
            for phrase in phrases:
                lines.append({"query": f"{SHOTS}Review: {subject} {phrase}.\nSentiment:", "label": label})
    path = Path(__file__).with_name("sentiment.jsonl")
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


if __name__ == "__main__":
    main()
