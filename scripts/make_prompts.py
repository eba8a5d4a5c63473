"""Write the mixed prompt sets in data/ (deterministic; re-run to regenerate).

    .venv/bin/python scripts/make_prompts.py

data/mixed_prompts.jsonl   128 prompts: 48 arithmetic (with answers), 48 chat, 32 code
data/default_prompts.jsonl  64 prompts: the first 24 arithmetic, 24 chat, 16 code of the set above
"""

import json
import random
from pathlib import Path

CHAT = [
    "What is the capital of France?", "Give me three tips for better sleep.", "Explain photosynthesis in two sentences.",
    "Write a haiku about autumn leaves.", "What are the primary colors?", "How do I make a cup of green tea?",
    "Suggest a name for a pet goldfish.", "Why is the sky blue?", "Describe a cat to someone who has never seen one.",
    "What is the difference between weather and climate?", "Recommend a good habit to start this week.",
    "Summarize the story of Cinderella in one paragraph.", "What should I pack for a weekend hike?",
    "Write a short thank-you note to a teacher.", "How many days are in a leap year, and why?",
    "What does a librarian do?", "Give two reasons to learn a second language.", "Explain what a rainbow is.",
    "Tell me a fun fact about octopuses.", "What is the tallest mountain in the world?",
    "How can I stay focused while studying?", "Write a one-sentence story about a robot.",
    "What is the boiling point of water at sea level?", "List three fruits that are rich in vitamin C.",
    "Explain gravity to a ten-year-old.", "What is a synonym for happy?", "How do bees make honey?",
    "Write a polite email declining a meeting invitation.", "What are the four seasons?",
    "Give me a simple recipe for pancakes.", "Why do we need to drink water?", "Describe the ocean in three words.",
    "What is the main job of the heart?", "Suggest a title for a mystery novel.",
    "How do airplanes stay in the air?", "What is the opposite of ancient?", "Name three planets in our solar system.",
    "Write a limerick about a clumsy dog.", "What is recycling and why does it matter?",
    "How do I politely ask a neighbor to turn down music?", "Explain what a verb is with an example.",
    "What makes a good friend?", "Give me a motivational quote and explain it.", "Why do leaves change color in fall?",
    "What is the largest animal on Earth?", "Describe your ideal weekend.", "What is the purpose of a map?",
    "How does a thermometer work?",
]
CODE = [
    "Write a Python function that reverses a string.", "Write a Python function to check if a number is prime.",
    "Write a SQL query that counts rows in a table named users.", "Write a JavaScript function that adds two numbers.",
    "Write a Python list comprehension that squares the numbers 1 to 10.", "Explain what a for loop does in Python.",
    "Write a Python function that returns the maximum of a list.", "Write a bash command that lists all files in a directory.",
    "Write a Python class for a point with x and y.", "Write a Python function that computes a factorial recursively.",
    "What does the len() function do in Python?", "Write a Python function that checks whether a word is a palindrome.",
    "Write a Python dictionary that maps three colors to their hex codes.", "Write a C function that swaps two integers.",
    "Write a Python function that counts vowels in a string.", "Write a regular expression that matches an email address.",
    "Write a Python function to compute the Fibonacci numbers up to n.", "What is the difference between a list and a tuple in Python?",
    "Write a Python function that merges two sorted lists.", "Write an HTML snippet for a button that says Click me.",
    "Write a Python function that removes duplicates from a list.", "Write a Python one-liner to read a file into a string.",
    "Write a Python function that converts Celsius to Fahrenheit.", "Explain what a variable is in programming.",
    "Write a Python function that returns the sum of even numbers in a list.", "Write a SQL query selecting names of users older than 30.",
    "Write a Python function that sorts a list of tuples by the second element.", "What does git commit do?",
    "Write a Python generator that yields squares forever.", "Write a Python function that flattens a nested list.",
    "Write a JSON object describing a book with title and author.", "Write a Python function that checks if a year is a leap year.",
]


def arithmetic(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        kind = ["add1", "mul1", "add2", "sub2"][i % 4]
        if kind == "add1":
            a, b = rng.randint(1, 9), rng.randint(1, 9); q, ans = f"{a} + {b}", a + b
        elif kind == "mul1":
            a, b = rng.randint(2, 9), rng.randint(2, 9); q, ans = f"{a} * {b}", a * b
        elif kind == "add2":
            a, b = rng.randint(10, 99), rng.randint(10, 99); q, ans = f"{a} + {b}", a + b
        else:
            a, b = rng.randint(50, 99), rng.randint(10, 49); q, ans = f"{a} - {b}", a - b
        out.append({"id": f"arith-{i:03d}", "prompt": f"What is {q}? Give the final answer as a number at the end.",
                    "answer": str(ans)})
    return out


def main() -> None:
    data = Path(__file__).resolve().parent.parent / "data"
    ar = arithmetic(48)
    chat = [{"id": f"chat-{i:03d}", "prompt": p} for i, p in enumerate(CHAT)]
    code = [{"id": f"code-{i:03d}", "prompt": p} for i, p in enumerate(CODE)]
    assert len(chat) == 48 and len(code) == 32
    mixed = [x for trio in zip(ar, chat, code + [None] * 16) for x in trio if x is not None]
    default = [x for trio in zip(ar[:24], chat[:24], code[:16] + [None] * 8) for x in trio if x is not None]
    for name, rows in (("mixed_prompts.jsonl", mixed), ("default_prompts.jsonl", default)):
        (data / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"wrote data/{name}: {len(rows)} prompts")


if __name__ == "__main__":
    main()
