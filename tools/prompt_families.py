"""The task families `dflash-prompts` asks the target to write requests of, and how each is
steered through the chat template (docs/TRAINING.md "Data").

A family is one kind of request a drafter should be ready for: programming in several
languages, maths and word problems, reasoning, writing and editing, factual questions,
instructions with constraints, and follow-up turns (a second user turn after the target's
own answer). Each family carries the material of the three steering methods measured
(bench/prompt_steering.py):

- `openings`: the first words of the user turn, pre-filled; the target writes the rest
  (`{lang}` is replaced by a programming language, drawn per prompt);
- `describe`: a system prompt describing the user, the user turn left empty;
- `seeds`: example requests shown in a system prompt, three drawn per prompt.

`check` is a simple, checkable on-family criterion (a regular expression over the request)
used to measure steering, not to filter: it is crude on purpose, so that anyone can read
what it counts. Pure data and small functions; no model here.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

LANGUAGES = ("Python", "JavaScript", "TypeScript", "Java", "C", "C++", "C#", "Go", "Rust", "SQL", "Bash", "Ruby",
             "PHP", "Kotlin", "Swift", "R", "Haskell")


@dataclass(frozen=True)
class Family:
    name: str
    describe: str  # system prompt of the `system` method
    openings: tuple[str, ...]  # first words of the user turn (`opening` method)
    seeds: tuple[str, ...]  # example requests (`seeds` method)
    check: re.Pattern  # the on-family criterion of the measurement
    follow_up: bool = False  # a second user turn, after a first request and the target's answer

    def opening(self, rng: random.Random) -> str:
        return rng.choice(self.openings).replace("{lang}", rng.choice(LANGUAGES))

    def seed_examples(self, rng: random.Random, k: int = 3) -> list[str]:
        return rng.sample(self.seeds, k)


def _rx(*alternatives: str) -> re.Pattern:
    return re.compile("|".join(alternatives), re.IGNORECASE)


_LANG_RX = r"\b(python|javascript|typescript|java|c\+\+|c#|golang|rust|sql|bash|ruby|php|kotlin|swift|haskell)\b"

PROGRAMMING = Family(
    "programming",
    "You are a software developer asking an AI assistant for help with code: writing functions, fixing "
    "bugs, explaining code, in Python, JavaScript, C++, Java, Rust, Go, SQL or shell scripts. Write your "
    "request as the user.",
    ("Write a {lang} function that", "How do I", "In {lang}, how can I", "Fix the bug in this {lang} code:",
     "Explain what this {lang} code does:", "Implement a {lang} class", "Write a {lang} program that",
     "What is the difference between", "Why does my {lang} code", "Write a SQL query that",
     "Convert this Python code to {lang}:", "Write unit tests for", "Optimize this {lang} function:",
     "Write a {lang} script to", "What does this error mean:", "Refactor this {lang} code", "Create a REST API in {lang}",
     "Write a regular expression that", "How can I read a file in {lang}", "Implement a"),
    ("Write a Python function that returns the n-th Fibonacci number.",
     "Why does my JavaScript loop print undefined after the last item?",
     "Write a SQL query that lists the customers with more than three orders.",
     "How do I reverse a linked list in C++?", "Explain what `git rebase` does and when to use it.",
     "Fix this Rust code: it says the borrowed value does not live long enough.",
     "Write a Bash script that renames every .txt file in a folder to .md.",
     "What is the difference between an interface and an abstract class in Java?",
     "Implement binary search in Go and explain its complexity.",
     "How can I make this Python list comprehension faster?",
     "Write a TypeScript type for a user with an optional email address.",
     "Convert this recursive function to an iterative one."),
    _rx(_LANG_RX, r"\b(code|function|program|script|algorithm|compile\w*|debug\w*|regex|regular expression|query|"
        r"class|method|variable|recursi\w+|api|database|implement\w*|array|loop|syntax|library|unit tests?)\b"),
)

MATHS = Family(
    "maths",
    "You are a student asking an AI assistant to solve maths problems: arithmetic, algebra, geometry, "
    "probability, calculus and word problems with numbers. Write your request as the user.",
    ("Solve for x:", "A train leaves", "Calculate", "What is the derivative of", "If a shop sells", "Prove that",
     "Find the area of", "Sarah has", "Simplify the expression", "What is 15% of", "A rectangle has",
     "How many ways can", "Compute the integral of", "A bag contains", "What is the probability that",
     "If a car travels", "Find the sum of", "John bought", "Factor the polynomial", "What is the average of"),
    ("Solve 3x + 7 = 22 and show each step.", "A train travels 180 km in 2.5 hours. What is its average speed?",
     "What is the derivative of x^3 * sin(x)?", "Find the area of a triangle with sides 5, 12 and 13.",
     "A shirt costs $40 after a 20% discount. What was the original price?",
     "How many ways can 5 people sit around a round table?",
     "Prove that the sum of two even numbers is even.", "What is the probability of rolling two sixes?",
     "Simplify (2x^2 - 8) / (x - 2).", "Tom has 3 times as many apples as Ann; together they have 48. How many "
     "does each have?", "Compute the integral of 1/x from 1 to e.", "What is 17% of 250?"),
    _rx(r"\d", r"\b(equation|solve|calculat\w+|comput\w+|sum|product|integral|derivative|probabilit\w+|percent\w*|"
        r"area|perimeter|volume|average|fraction|prime|triangle|circle|how many|how much|algebra|geometry|"
        r"polynomial|factor|simplify|prove|math\w*)\b"),
)

REASONING = Family(
    "reasoning",
    "You are a curious person asking an AI assistant logic puzzles, riddles and questions that need "
    "step-by-step reasoning, comparisons and what-if analysis. Write your request as the user.",
    ("If all", "Which is heavier,", "A farmer needs to cross a river", "What comes next in the sequence",
     "Three friends", "Is the following argument valid?", "Explain step by step why", "Solve this riddle:",
     "Suppose that", "What would happen if", "Compare the pros and cons of", "Think it through:",
     "Two people", "Why would", "Is it possible that", "Here is a logic puzzle:", "Which option is better,",
     "If today is", "A man looks at a photograph", "What is wrong with this reasoning:"),
    ("If all cats are mammals and some mammals swim, do some cats swim?",
     "Which is heavier, a kilogram of feathers or a kilogram of steel?",
     "A farmer must cross a river with a wolf, a goat and a cabbage. How does he do it?",
     "What comes next in the sequence 2, 6, 12, 20, 30?",
     "Alice is older than Bob, and Bob is older than Carol. Who is the youngest?",
     "Is this argument valid: if it rains the ground is wet; the ground is wet, so it rained?",
     "What would happen to tides if the Moon were twice as far away?",
     "Compare renting and buying a house for someone who moves every two years.",
     "If today is Wednesday, what day will it be in 100 days?",
     "Three boxes are labelled wrongly. How can you fix the labels by opening one box?",
     "Why do we see lightning before we hear thunder? Explain step by step.",
     "Should a small town build a new road or a new school first? Weigh both sides."),
    _rx(r"\b(logic\w*|puzzle|riddle|deduc\w+|sequence|step[- ]by[- ]step|reason\w*|argument|suppose|conclu\w+|"
        r"valid|compare|pros and cons|would happen|what if|true or false|older than|younger than|heavier|weigh|"
        r"trade-?offs?|which (is|one|option)|therefore)\b", r"\b(if|suppose|assuming|given that)\b.*(\?|\b(then|would|"
        r"will)\b)", r"^\s*why\b"),
)

WRITING = Family(
    "writing",
    "You are a writer asking an AI assistant to write, rewrite, edit, proofread, shorten or summarise "
    "texts: stories, poems, emails, essays, letters and posts. Write your request as the user.",
    ("Rewrite this paragraph to be more formal:", "Write a short story about", "Proofread the following text:",
     "Write an email to", "Summarize the following", "Write a poem about", "Make this sentence more concise:",
     "Write a cover letter for", "Translate into French:", "Write a product description for",
     "Write a blog post about", "Edit this essay for clarity:", "Write a speech for", "Paraphrase this:",
     "Write a letter to", "Give me a catchy title for", "Write the opening paragraph of", "Improve the tone of",
     "Write a review of", "Turn these notes into a paragraph:"),
    ("Rewrite this sentence to sound more polite: send me the report now.",
     "Write a short story about a lighthouse keeper who finds a message in a bottle.",
     "Proofread this: their going to the park tomorow, weather permiting.",
     "Write an email asking my manager for a day off next Friday.",
     "Summarize the plot of Romeo and Juliet in a paragraph.", "Write a poem about autumn in the city.",
     "Make this paragraph more concise without losing its meaning.",
     "Write a cover letter for a junior data analyst position.",
     "Write a product description for a reusable water bottle.",
     "Edit my essay introduction so that it grabs the reader's attention.",
     "Write a toast for my sister's wedding.", "Translate 'Where is the train station?' into Spanish."),
    _rx(r"\b(write|rewrite|edit|proofread|revise|summari[sz]e|summary|paraphrase|essay|story|poem|letter|email|"
        r"paragraph|sentence|tone|formal|concise|blog|article|draft|translate|speech|title|review|description|"
        r"toast)\b"),
)

FACTUAL = Family(
    "factual",
    "You are a curious person asking an AI assistant factual questions about science, history, geography, "
    "health, technology and culture. Write your question as the user.",
    ("What is the capital of", "Who invented", "When did", "How does", "Why is the", "What are the main causes of",
     "Explain how", "Who was", "Where is", "How many", "What is the difference between", "What is",
     "How do", "Which country", "What happened during", "Why do", "Tell me about", "What are the symptoms of",
     "How long does it take", "Who wrote"),
    ("What is the capital of Australia?", "Who invented the telephone?", "When did the Berlin Wall fall?",
     "How does photosynthesis work?", "Why is the sky blue?", "What were the main causes of World War I?",
     "How do vaccines train the immune system?", "Where is Mount Kilimanjaro?",
     "How many bones are in the human body?", "What is the difference between weather and climate?",
     "Who wrote Pride and Prejudice?", "What does DNA stand for?"),
    _rx(r"^\s*(what|who|when|where|which|how|why|is|are|was|were|did|does|do|can|tell me|explain|describe)\b",
        r"\?\s*$"),
)

CONSTRAINTS = Family(
    "constraints",
    "You are a user giving an AI assistant instructions with explicit constraints on the answer: a word "
    "or sentence limit, a format such as a list, a table or JSON, a style, words to use or avoid. Write "
    "your request as the user.",
    ("In exactly three sentences,", "Write a haiku about", "List five", "Without using the letter e,",
     "Answer in one word:", "In under 50 words, explain", "Give me a numbered list of",
     "Write a tweet (under 280 characters) about", "Respond only in JSON with the keys",
     "Using bullet points, summarize", "Explain to a five-year-old", "In a table with two columns,",
     "Write exactly two paragraphs about", "Give three reasons why", "In one sentence, describe",
     "Write a limerick about", "Without mentioning", "Reply in all capital letters:", "Using only simple words,",
     "Write 10 questions about"),
    ("In exactly three sentences, explain how a refrigerator works.", "Write a haiku about morning coffee.",
     "List five tips for better sleep, one line each.", "Answer in one word: what color is chlorophyll?",
     "In under 50 words, describe the water cycle.", "Give me a numbered list of 7 fruits rich in vitamin C.",
     "Respond only in JSON with the keys name and age for three fictional people.",
     "Explain gravity to a five-year-old without using the word 'force'.",
     "Make a table with two columns: country and capital, for five countries.",
     "Write a product slogan of at most eight words.", "Summarize the news in three bullet points.",
     "Write two sentences about the ocean, each starting with the letter S."),
    _rx(r"\b(exactly|at most|no more than|at least|under \d+|in \d+ words|only|bullet\w*|numbered|json|table|haiku|"
        r"limerick|do not|don't|must|without|one (word|sentence|line|paragraph)|(two|three|four|five|ten|\d+) "
        r"(words|sentences|paragraphs|lines|bullet points|reasons|tips|questions|items|examples)|format|"
        r"capital letters|five-year-old|tweet)\b", r"\blist (\d+|three|four|five|six|seven|ten)\b"),
)

FOLLOW_UP = Family(
    "follow_up",
    "You are a user continuing a conversation with an AI assistant: your next message is a follow-up to "
    "its last answer (ask for more detail, an example, a change, a correction or a related question). "
    "Write your follow-up as the user.",
    ("Can you", "Thanks! Now", "Could you explain", "What about", "Make it", "Can you give an example of",
     "Why did you", "That's not quite right.", "Now do the same for", "I don't understand", "Could you shorten",
     "Great. Can you also", "How would this change if", "Can you rewrite it", "What if", "Is there a simpler way",
     "Can you add", "Please expand on", "Are you sure about", "OK, and"),
    ("Can you give me an example of that?", "Thanks! Now make it shorter.", "Why did you choose that approach?",
     "That's not quite right: the second step is wrong. Can you fix it?", "What about the edge case of an empty "
     "input?", "Can you explain the last part in simpler words?", "Now do the same for the other list.",
     "Could you add comments to the code?", "Is there a faster way to do this?", "Are you sure? I thought it "
     "was the other way round.", "Can you turn that into a table?", "How would this change in winter?"),
    _rx(r"\b(above|previous|again|also|instead|another|the same|more detail|shorter|longer|simpler|example|"
        r"you (said|wrote|mentioned|gave|suggested|used|did|chose)|your (answer|code|example|list|explanation|"
        r"story|poem|response|solution|suggestion|text|email|version)|the (code|list|story|poem|answer|example|"
        r"text|email|table|steps?|function|result|first|second|last|other)|are you sure|not quite right|"
        r"(don't|do not) understand|expand on|how would this)\b",
        r"^\s*(and|now|ok|okay|thanks|great|what about|why did|what if)\b",
        r"^\s*(can|could) you (add|rewrite|shorten|expand|explain|turn|make|change|fix|simplify)\b"),
    follow_up=True,
)

FAMILIES: dict[str, Family] = {f.name: f for f in (PROGRAMMING, MATHS, REASONING, WRITING, FACTUAL, CONSTRAINTS,
                                                   FOLLOW_UP)}


def on_family(family: Family, text: str) -> bool:
    """Whether `text` meets `family`'s criterion (the measurement's, docs/TRAINING.md)."""
    return family.check.search(text) is not None


class FamilySpecError(ValueError):
    """A `--families` value that names no family or gives a bad weight."""


def parse_families(spec: str | None) -> dict[str, float]:
    """`--families`: "NAME[=WEIGHT],..." -> {name: weight}; None or "all": every family, weight 1."""
    if spec is None or spec.strip().lower() == "all":
        return {name: 1.0 for name in FAMILIES}
    out: dict[str, float] = {}
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        name, _, weight = part.partition("=")
        name = name.strip()
        if name not in FAMILIES:
            raise FamilySpecError(f"{name!r} is not a family; choose from {', '.join(FAMILIES)}")
        if name in out:
            raise FamilySpecError(f"{name!r} is given twice")
        try:
            w = float(weight) if weight else 1.0
        except ValueError:
            raise FamilySpecError(f"{part!r}: the weight {weight!r} is not a number") from None
        if not w > 0:
            raise FamilySpecError(f"{part!r}: a weight must be > 0 (leave a family out instead)")
        out[name] = w
    if not out:
        raise FamilySpecError(f"no family named in {spec!r}")
    return out


def split_count(count: int, weights: dict[str, float]) -> dict[str, int]:
    """`count` prompts shared by weight, rounded so they add up to `count` exactly (largest
    remainders first, ties in the order given)."""
    total = sum(weights.values())
    exact = {n: count * w / total for n, w in weights.items()}
    out = {n: int(e) for n, e in exact.items()}
    order = sorted(weights, key=lambda n: -(exact[n] - out[n]))  # stable: ties keep the given order
    for n in order[: count - sum(out.values())]:
        out[n] += 1
    return out
