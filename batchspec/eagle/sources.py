"""What `train-draft` gives the target to answer or read, beyond the prompt sets and the user's files.

- `self:N` asks the target to write N questions itself (`QUESTION`, one per topic in turn, sampled).
- `ask:N`: N instructions from templates, a form about a topic (`instructions`): no model call,
  every (form, topic) pair once before any repeats.
- `docs`: plain English text found wherever Python runs (`package_docs`), read teacher-forced.

Measured on SmolLM2 (equal CPU time for each source's data, 2.4-2.6 minutes, then 400 steps of the
same head, held out: the chat and grounded prompt sets' greedy answers): top-1 0.239 from `ask`
answers (chat 0.289, grounded 0.164), 0.210 from `self` answers (chat 0.227), 0.204 from `docs`
(chat 0.190): a prefill reads 237k entries of text in the time decoding writes 74k-94k, yet text
buys about what answers do, more on grounded prompts (whose answers copy their text) and less on chat.
"""

from __future__ import annotations

import re
from importlib import metadata

import torch

# `self:N`: N questions the target writes itself (sampled), one per topic in turn, then answers
TOPICS = ("cooking", "gardening", "personal finance", "ancient history", "astronomy", "chemistry", "physics",
          "biology", "geography", "travel planning", "fitness", "nutrition", "sleep", "mental health",
          "programming in Python", "web development", "databases", "computer networks", "machine learning",
          "mathematics", "statistics", "music", "painting", "photography", "film", "literature", "poetry",
          "philosophy", "economics", "politics", "law", "climate", "renewable energy", "cars", "bicycles",
          "pets", "wild animals", "oceans", "weather", "languages", "grammar", "writing emails", "job interviews",
          "careers", "parenting", "education", "study tips", "productivity", "home repair", "fashion",
          "sports", "board games", "video games", "space exploration", "medicine", "first aid", "psychology",
          "sociology", "architecture", "engineering", "electronics", "smartphones", "internet safety",
          "cryptography", "world religions", "mythology", "famous scientists", "inventions", "festivals",
          "recipes", "baking", "coffee and tea", "hiking", "camping", "minimalism", "budget travel",
          "public speaking", "negotiation", "friendship", "time management", "the human body", "plants")
QUESTION = "Write one question that someone might ask an AI assistant about {}. Reply with the question only."
# `ask:N`: N instructions, each a form below about a topic above (every pair once before any repeats)
FORMS = ("Explain {} to a beginner.", "What are the most common mistakes people make with {}?",
         "Give me five tips about {}.", "Write a short paragraph about {}.", "What is the history of {}?",
         "List four interesting facts about {}.", "How do I get started with {}?", "Write a limerick about {}.",
         "What are the pros and cons of {}?", "Summarize the key ideas of {} in a few sentences.",
         "Write a short story that involves {}.", "Why do people care about {}?",
         "What is a good way to learn about {}?", "Describe a typical day for someone who works in {}.",
         "What questions should I ask an expert in {}?", "Explain one important concept in {} with an example.",
         "Write a friendly message inviting a friend to try {}.", "What are three myths about {}?",
         "Compare two different approaches to {}.", "Write a short dialogue between two people about {}.",
         "What has changed about {} in the last fifty years?", "Make a simple plan for a weekend of {}.",
         "What words should a beginner in {} know? Define each briefly.", "Write a product description for "
         "something related to {}.")


def instructions(count: int, seed: int = 0) -> list[str]:
    """`count` chat instructions: the (form, topic) pairs in a seeded order, repeating after all of
    them (len(FORMS) x len(TOPICS) = 1,968) have been used."""
    pairs = [(f, t) for f in FORMS for t in TOPICS]
    order = torch.randperm(len(pairs), generator=torch.Generator().manual_seed(seed)).tolist()
    chosen = [pairs[order[i % len(pairs)]] for i in range(count)]
    return [form.format(topic) for form, topic in chosen]


def package_docs(min_chars: int = 400, max_chars: int = 6000) -> list[str]:
    """The long descriptions (READMEs) of the installed Python distributions and Python's pydoc
    topics, cut at level-1 and level-2 Markdown headings; pieces shorter than `min_chars` dropped,
    longer ones cut at `max_chars`. The same on every machine with the same packages installed."""
    import pydoc_data.topics

    texts = {}
    for dist in metadata.distributions():
        name = dist.metadata.get("Name")
        raw = dist.read_text("METADATA") or ""
        if name and "\n\n" in raw:
            texts.setdefault(name.lower(), raw.split("\n\n", 1)[1])
    pieces = [part for _, text in sorted(texts.items()) for part in re.split(r"\n(?=#{1,2} )", text)]
    pieces += [text for _, text in sorted(pydoc_data.topics.topics.items())]
    return [p[:max_chars] for p in pieces if len(p) >= min_chars]
