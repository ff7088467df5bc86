"""Generate the sample datasets shipped in data/samples/ (deterministic: fixed seed).

    python scripts/make_sample_data.py [--out data/samples]

The conversations are written for this project from templates: arithmetic, unit
conversions, calendar questions, spelling, sorting, short recipes and tool-using
flows. The text is varied but regular, so that the tiny builtin target learns it in a
few hundred steps and a drafter can then predict the target well. Each file uses a
different source layout, so the sample config exercises every reader of `prepare`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

SEED = 20250601
OUT_DIR = Path(__file__).resolve().parent.parent / "data" / "samples"

# How many conversations each file gets.
COUNTS = {"chat_openai": 160, "sharegpt_plain": 100, "sharegpt_tools": 20, "tools": 90,
          "recipes": 80, "prompts_only": 60, "held_out": 40}

SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a helpful assistant. Answer clearly and briefly.",
    "You are a patient tutor. Show one short check for every answer.",
    "You are a friendly assistant who explains things step by step.",
    "You are a concise assistant. Keep answers short and exact.",
]
TOOL_SYSTEM_PROMPT = (
    "You are a helpful assistant with access to tools. Call a tool when you need live data "
    "or exact arithmetic, then answer from its result."
)

WORDS = [
    "garden", "necessary", "elephant", "banana", "library", "window", "calendar", "pencil",
    "yellow", "bicycle", "kitchen", "mountain", "river", "blanket", "tomato", "orange",
    "rhythm", "beautiful", "business", "separate", "friend", "science", "island", "weather",
    "button", "letter", "coffee", "balloon", "address", "committee", "guitar", "jacket",
    "lemon", "market", "notebook", "octopus", "puzzle", "rabbit", "summer", "teacher",
    "umbrella", "village", "whistle", "zebra", "anchor", "bottle", "candle", "dolphin",
    "engine", "forest", "harbor", "insect", "jungle", "ladder", "mirror", "needle",
    "pepper", "planet", "rocket", "spinach", "tunnel", "violin", "wonder", "breakfast",
]
SORT_WORDS = [
    "apple", "river", "cloud", "mango", "stone", "piano", "tiger", "lemon", "bread",
    "chair", "ocean", "grape", "house", "zebra", "kite", "onion", "paper", "sugar",
    "violet", "walnut", "yogurt", "carrot", "dragon", "forest", "honey", "island",
]
CITIES = [
    "Lisbon", "Oslo", "Nairobi", "Toronto", "Madrid", "Seoul", "Lima", "Dublin", "Cairo",
    "Vienna", "Perth", "Denver", "Hanoi", "Prague", "Quito", "Athens", "Helsinki", "Austin",
]
CONDITIONS = ["sunny", "cloudy", "rainy", "windy", "foggy", "clear", "snowy", "humid"]
CURRENCIES = {"USD": "US dollars", "EUR": "euros", "GBP": "British pounds",
              "JPY": "Japanese yen", "CAD": "Canadian dollars", "CHF": "Swiss francs"}
# Units of one currency per US dollar (fixed, fictional rates for the samples).
RATES = {"USD": 1.0, "EUR": 0.92, "GBP": 0.79, "JPY": 151.0, "CAD": 1.36, "CHF": 0.9}

# (from, to, factor): value_in_to = value_in_from * factor
CONVERSIONS = [
    ("kilometers", "miles", 0.621371), ("miles", "kilometers", 1.609344),
    ("kilograms", "pounds", 2.20462), ("pounds", "kilograms", 0.453592),
    ("meters", "feet", 3.28084), ("feet", "meters", 0.3048),
    ("inches", "centimeters", 2.54), ("centimeters", "inches", 0.393701),
    ("liters", "cups", 4.22675), ("hours", "minutes", 60.0), ("minutes", "seconds", 60.0),
]
SINGULAR = {"kilometers": "kilometer", "miles": "mile", "kilograms": "kilogram",
            "pounds": "pound", "meters": "meter", "feet": "foot", "inches": "inch",
            "centimeters": "centimeter", "liters": "liter", "cups": "cup", "hours": "hour",
            "minutes": "minute", "seconds": "second"}


@dataclass(frozen=True)
class Recipe:
    name: str
    # per serving: (amount, unit, ingredient)
    per_serving: tuple[tuple[float, str, str], ...]
    steps: tuple[str, ...]


RECIPES = [
    Recipe("pancakes", ((60, "grams", "flour"), (80, "ml", "milk"), (0.5, "", "eggs"),
                        (5, "grams", "sugar")),
           ("Whisk the flour, sugar, milk and eggs into a smooth batter.",
            "Heat a lightly oiled pan over medium heat.",
            "Pour in small ladles of batter and cook each side for about two minutes.")),
    Recipe("tomato soup", ((250, "grams", "tomatoes"), (0.5, "", "onions"),
                           (150, "ml", "vegetable stock"), (10, "ml", "olive oil")),
           ("Soften the chopped onion in the olive oil for five minutes.",
            "Add the tomatoes and the stock and simmer for twenty minutes.",
            "Blend until smooth and season with salt and pepper.")),
    Recipe("vegetable fried rice", ((80, "grams", "cooked rice"), (60, "grams", "mixed vegetables"),
                                    (1, "", "eggs"), (10, "ml", "soy sauce")),
           ("Scramble the eggs in a hot pan and set them aside.",
            "Stir fry the vegetables for three minutes.",
            "Add the rice, the eggs and the soy sauce and toss until hot.")),
    Recipe("omelette", ((2, "", "eggs"), (20, "grams", "cheese"), (10, "grams", "butter"),
                        (1, "pinch of", "salt")),
           ("Beat the eggs with the salt.",
            "Melt the butter in a pan and pour in the eggs.",
            "Add the cheese, fold the omelette and cook for one more minute.")),
    Recipe("lemonade", ((1, "", "lemons"), (20, "grams", "sugar"), (250, "ml", "cold water")),
           ("Squeeze the lemons into a jug.",
            "Stir in the sugar until it dissolves.",
            "Add the cold water and ice, then taste and adjust the sugar.")),
    Recipe("guacamole", ((1, "", "avocados"), (0.5, "", "limes"), (20, "grams", "red onion"),
                         (1, "pinch of", "salt")),
           ("Mash the avocados with a fork.",
            "Stir in the lime juice and the finely chopped onion.",
            "Season with salt and serve right away.")),
    Recipe("banana smoothie", ((1, "", "bananas"), (150, "ml", "milk"), (50, "grams", "yogurt"),
                               (5, "grams", "honey")),
           ("Peel and slice the bananas.",
            "Blend them with the milk, yogurt and honey for one minute.",
            "Pour into glasses and serve cold.")),
    Recipe("garlic pasta", ((100, "grams", "spaghetti"), (1, "", "garlic cloves"),
                            (15, "ml", "olive oil"), (10, "grams", "parmesan")),
           ("Cook the spaghetti in salted boiling water.",
            "Warm the sliced garlic gently in the olive oil.",
            "Toss the drained pasta with the garlic oil and the parmesan.")),
    Recipe("oatmeal", ((50, "grams", "rolled oats"), (200, "ml", "milk"), (5, "grams", "honey")),
           ("Bring the milk to a gentle simmer.",
            "Stir in the oats and cook for five minutes, stirring often.",
            "Sweeten with honey and add fruit if you like.")),
    Recipe("green salad", ((60, "grams", "lettuce"), (0.5, "", "cucumbers"), (10, "ml", "olive oil"),
                           (5, "ml", "lemon juice")),
           ("Wash and dry the lettuce.",
            "Slice the cucumber thinly.",
            "Toss everything with the olive oil and lemon juice just before serving.")),
    Recipe("lentil soup", ((60, "grams", "red lentils"), (0.5, "", "carrots"),
                           (250, "ml", "vegetable stock"), (1, "pinch of", "cumin")),
           ("Rinse the lentils under cold water.",
            "Simmer the lentils, diced carrots and cumin in the stock for twenty five minutes.",
            "Season with salt and blend half of the soup for a creamy texture.")),
    Recipe("rice pudding", ((40, "grams", "short grain rice"), (250, "ml", "milk"),
                            (15, "grams", "sugar")),
           ("Put the rice, milk and sugar in a saucepan.",
            "Simmer gently for thirty minutes, stirring now and then.",
            "Serve warm with a pinch of cinnamon.")),
]

MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August",
          "September", "October", "November", "December"]
WEEKDAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]


# ---- small helpers ---------------------------------------------------------------------


def fmt_num(x: float) -> str:
    """2 decimals, without trailing zeros (7.46, 3.5, 12)."""
    text = f"{x:.2f}".rstrip("0").rstrip(".")
    return text if text != "-0" else "0"


def fmt_date(d: dt.date) -> str:
    return f"{d.day} {MONTHS[d.month - 1]} {d.year}"


def spelled(word: str) -> str:
    return "-".join(word)


def join_list(items: list[str]) -> str:
    return ", ".join(items)


def random_date(rng: random.Random) -> dt.date:
    return dt.date(2000, 1, 1) + dt.timedelta(days=rng.randrange(365 * 30))


def plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


# ---- question/answer tasks -------------------------------------------------------------
# A task returns (question, answer, follow_up); follow_up, when not None, makes the
# next (question, answer) pair of a multi-turn conversation about the same thing.

FollowUp = Callable[[random.Random], tuple[str, str]] | None
QA = tuple[str, str, FollowUp]


def times_answer(a: int, b: int) -> str:
    c = a * b
    if b < 10:
        return (f"{a} times {b} equals {c}. That is {b} groups of {a}, and adding {a} to itself "
                f"{b} times gives {c}. The answer is {c}.")
    tens, ones = b - b % 10, b % 10
    check = f"{a} × {tens} = {a * tens} and {a} × {ones} = {a * ones}, and {a * tens} + {a * ones} = {c}"
    return f"{a} times {b} equals {c}. Split {b} into {tens} and {ones}: {check}. The answer is {c}."


def arithmetic(rng: random.Random) -> QA:
    op = rng.choice(["plus", "minus", "times", "divided"])
    if op == "plus":
        a, b = rng.randint(10, 999), rng.randint(10, 999)
        c = a + b
        q = rng.choice([f"What is {a} plus {b}?", f"Can you add {a} and {b}?", f"Compute {a} + {b}."])
        ans = (f"{a} plus {b} equals {c}. To check, subtract {b} from {c} and you get {a} back. "
               f"The answer is {c}.")
    elif op == "minus":
        a, b = sorted((rng.randint(10, 999), rng.randint(10, 999)), reverse=True)
        c = a - b
        q = rng.choice([f"What is {a} minus {b}?", f"Subtract {b} from {a}.", f"Compute {a} - {b}."])
        ans = f"{a} minus {b} equals {c}. To check, add {b} and {c}: the sum is {a}. The answer is {c}."
    elif op == "times":
        a, b = rng.randint(3, 99), rng.randint(3, 49)
        c = a * b
        q = rng.choice([f"What is {a} times {b}?", f"Multiply {a} by {b}.", f"Compute {a} × {b}."])
        ans = times_answer(a, b)
    else:
        b, c = rng.randint(2, 19), rng.randint(2, 60)
        a = b * c
        q = rng.choice([f"What is {a} divided by {b}?", f"Divide {a} by {b}.", f"Compute {a} / {b}."])
        ans = (f"{a} divided by {b} equals {c}, because {b} times {c} is {a}. Taking {b} away "
               f"from {a} exactly {c} times leaves nothing over. The answer is {c}.")

    def follow(rng: random.Random) -> tuple[str, str]:
        k = rng.randint(2, 9)
        return (rng.choice([f"Now multiply that by {k}.", f"And what is that times {k}?"]),
                times_answer(c, k))

    return q, ans, follow


def conversion_qa(rng: random.Random, src: str, dst: str, factor: float, v: int) -> tuple[str, str]:
    r = v * factor
    q = rng.choice([f"Convert {v} {src} to {dst}.", f"How many {dst} are in {v} {src}?",
                    f"What is {v} {src} in {dst}?"])
    ans = (f"{v} {src} is about {fmt_num(r)} {dst}. One {SINGULAR[src]} is {fmt_num(factor)} "
           f"{dst}, so {v} × {fmt_num(factor)} = {fmt_num(r)}. The answer is {fmt_num(r)} {dst}.")
    return q, ans


def temperature_qa(rng: random.Random, to_f: bool, v: int) -> tuple[str, str]:
    if to_f:
        m = v * 1.8
        r = m + 32
        q = rng.choice([f"Convert {v} degrees Celsius to Fahrenheit.",
                        f"What is {v} °C in Fahrenheit?"])
        ans = (f"{v} degrees Celsius is {fmt_num(r)} degrees Fahrenheit. Multiply by 1.8 and "
               f"add 32: {v} × 1.8 = {fmt_num(m)}, and {fmt_num(m)} + 32 = {fmt_num(r)}.")
    else:
        d = v - 32
        r = d / 1.8
        q = rng.choice([f"Convert {v} degrees Fahrenheit to Celsius.",
                        f"What is {v} °F in Celsius?"])
        ans = (f"{v} degrees Fahrenheit is {fmt_num(r)} degrees Celsius. Subtract 32 and divide "
               f"by 1.8: {v} - 32 = {d}, and {d} / 1.8 = {fmt_num(r)}.")
    return q, ans


def conversion(rng: random.Random) -> QA:
    if rng.random() < 0.2:
        to_f = rng.random() < 0.5
        low, high = (-20, 45) if to_f else (0, 110)
        q, ans = temperature_qa(rng, to_f, rng.randint(low, high))

        def follow_t(rng: random.Random) -> tuple[str, str]:
            v2 = rng.randint(low, high)
            _, a2 = temperature_qa(rng, to_f, v2)
            return f"And {v2} degrees?", a2

        return q, ans, follow_t
    src, dst, factor = rng.choice(CONVERSIONS)
    q, ans = conversion_qa(rng, src, dst, factor, rng.randint(2, 250))

    def follow(rng: random.Random) -> tuple[str, str]:
        v2 = rng.randint(2, 250)
        _, a2 = conversion_qa(rng, src, dst, factor, v2)
        return f"And {v2} {src}?", a2

    return q, ans, follow


def weekday_qa(rng: random.Random, d: dt.date) -> tuple[str, str]:
    first, nxt = d.replace(day=1), d + dt.timedelta(days=1)
    q = rng.choice([f"What day of the week was {fmt_date(d)}?", f"Which weekday is {fmt_date(d)}?",
                    f"On what day of the week does {fmt_date(d)} fall?"])
    ans = (f"{fmt_date(d)} is a {WEEKDAYS[d.weekday()]}. It is day {d.timetuple().tm_yday} of "
           f"{d.year}, and {MONTHS[d.month - 1]} {d.year} began on a {WEEKDAYS[first.weekday()]}. "
           f"The next day, {fmt_date(nxt)}, is a {WEEKDAYS[nxt.weekday()]}.")
    return q, ans


def dates(rng: random.Random) -> QA:
    kind = rng.choice(["weekday", "after", "between"])
    d = random_date(rng)
    if kind == "weekday":
        q, ans = weekday_qa(rng, d)

        def follow(rng: random.Random) -> tuple[str, str]:
            d2 = random_date(rng)
            _, a2 = weekday_qa(rng, d2)
            return f"And {fmt_date(d2)}?", a2

        return q, ans, follow
    if kind == "after":
        n = rng.randint(3, 120)
        d2 = d + dt.timedelta(days=n)
        q = rng.choice([f"What date is {n} days after {fmt_date(d)}?",
                        f"Which date comes {n} days after {fmt_date(d)}?"])
        weeks, rest = divmod(n, 7)
        ans = (f"{n} days after {fmt_date(d)}, a {WEEKDAYS[d.weekday()]}, is {fmt_date(d2)}, "
               f"which is a {WEEKDAYS[d2.weekday()]}. {n} days is {plural(weeks, 'week')} and "
               f"{plural(rest, 'day')}, so the weekday moves forward by {rest}.")
        return q, ans, None
    d2 = d + dt.timedelta(days=rng.randint(5, 400))
    n = (d2 - d).days
    weeks, rest = divmod(n, 7)
    q = rng.choice([f"How many days are there between {fmt_date(d)} and {fmt_date(d2)}?",
                    f"Count the days from {fmt_date(d)} to {fmt_date(d2)}."])
    ans = (f"There are {n} days between {fmt_date(d)} and {fmt_date(d2)}. That is "
           f"{plural(weeks, 'week')} and {plural(rest, 'day')}. Counting both {fmt_date(d)} and "
           f"{fmt_date(d2)} gives {n + 1} days.")
    return q, ans, None


def spell_qa(rng: random.Random, word: str, kind: str) -> tuple[str, str]:
    n = len(word)
    if kind == "spell":
        q = rng.choice([f"How do you spell {word}?", f"Spell the word {word}.",
                        f"Can you spell {word} for me?"])
        ans = (f"The word {word} is spelled {spelled(word)}. It has {n} letters, starts with "
               f"the letter {word[0]} and ends with the letter {word[-1]}.")
    elif kind == "backwards":
        q = rng.choice([f"Spell {word} backwards.", f"What is {word} written backwards?"])
        ans = (f"Backwards, {word} is {word[::-1]}. Letter by letter: {spelled(word[::-1])}. "
               f"The word has {n} letters, and read forwards again it is {word}.")
    elif kind == "count":
        vowels = sum(ch in "aeiou" for ch in word)
        q = rng.choice([f"How many letters are in the word {word}?",
                        f"How long is the word {word}?"])
        ans = (f"The word {word} has {n} letters: {spelled(word)}. It has "
               f"{plural(vowels, 'vowel')} and {plural(n - vowels, 'consonant')}. The first letter "
               f"is {word[0]} and the last letter is {word[-1]}.")
    else:
        letter = rng.choice(sorted(set(word)))
        k = word.count(letter)
        q = f"How many times does the letter {letter} appear in {word}?"
        ans = (f"The letter {letter} appears {'once' if k == 1 else f'{k} times'} in {word}. "
               f"Spelled out, the word is {spelled(word)}. It has {n} letters in total, and "
               f"{letter} first appears as letter number {word.index(letter) + 1}.")
    return q, ans


def spelling(rng: random.Random) -> QA:
    kind = rng.choice(["spell", "backwards", "count", "letter"])
    q, ans = spell_qa(rng, rng.choice(WORDS), kind)

    def follow(rng: random.Random) -> tuple[str, str]:
        word2 = rng.choice(WORDS)
        _, a2 = spell_qa(rng, word2, kind)
        return rng.choice([f"Now do the same for {word2}.", f"And {word2}?"]), a2

    return q, ans, follow


def sorting(rng: random.Random) -> QA:
    if rng.random() < 0.35:
        words = rng.sample(SORT_WORDS, rng.randint(4, 7))
        q = rng.choice([f"Put these words in alphabetical order: {join_list(words)}.",
                        f"Sort alphabetically: {join_list(words)}."])
        s = sorted(words)
        ans = (f"In alphabetical order: {join_list(s)}. The first word is {s[0]} and the last "
               f"is {s[-1]}. There are {len(s)} words in the list.")

        def follow_w(rng: random.Random) -> tuple[str, str]:
            r = s[::-1]
            return ("Now in reverse order.",
                    f"In reverse alphabetical order: {join_list(r)}. The first word is {r[0]} "
                    f"and the last is {r[-1]}. There are {len(r)} words in the list.")

        return q, ans, follow_w
    nums = rng.sample(range(1, 100), rng.randint(4, 8))
    text = join_list([str(n) for n in nums])
    s = sorted(nums)
    q = rng.choice([f"Sort these numbers from smallest to largest: {text}.",
                    f"Put these numbers in ascending order: {text}."])
    ans = (f"From smallest to largest: {join_list([str(n) for n in s])}. The smallest number "
           f"is {s[0]} and the largest is {s[-1]}. There are {len(s)} numbers in the list.")

    def follow(rng: random.Random) -> tuple[str, str]:
        r = s[::-1]
        return (rng.choice(["Now sort them from largest to smallest.", "And in descending order?"]),
                f"From largest to smallest: {join_list([str(n) for n in r])}. The largest number "
                f"is {r[0]} and the smallest is {r[-1]}. The difference between them is "
                f"{r[0] - r[-1]}.")

    return q, ans, follow


def recipe_answer(recipe: Recipe, people: int, prefix: str = "") -> str:
    parts = []
    for amount, unit, name in recipe.per_serving:
        total = amount * people
        if unit == "pinch of":
            parts.append(f"{'a pinch' if people < 4 else 'two pinches'} of {name}")
        elif unit:
            parts.append(f"{fmt_num(total)} {unit} of {name}")
        else:
            parts.append(f"{fmt_num(max(total, 1))} {name}")
    steps = " ".join(f"{i}. {step}" for i, step in enumerate(recipe.steps, start=1))
    return (f"{prefix}{recipe.name.capitalize()} for {plural(people, 'person').replace('persons', 'people')}. "
            f"Ingredients: {join_list(parts)}. Steps: {steps} Enjoy!")


def recipes(rng: random.Random) -> QA:
    recipe = rng.choice(RECIPES)
    people = rng.randint(1, 6)
    who = plural(people, "person").replace("persons", "people")
    q = rng.choice([f"Give me a short recipe for {recipe.name} for {who}.",
                    f"How do I make {recipe.name} for {who}?",
                    f"I need a simple {recipe.name} recipe that serves {people}."])

    def follow(rng: random.Random) -> tuple[str, str]:
        m = rng.choice([n for n in range(1, 9) if n != people])
        return (f"Can I make it for {m} instead?",
                recipe_answer(recipe, m, prefix="Yes, scale every ingredient. "))

    return q, recipe_answer(recipe, people), follow


PLAIN_TASKS = {"arithmetic": arithmetic, "conversion": conversion, "dates": dates,
               "spelling": spelling, "sorting": sorting, "recipes": recipes}


def plain_turns(rng: random.Random, tasks: list[str]) -> list[tuple[str, str]]:
    """1-3 (user, assistant) pairs: a task, maybe its follow-up, maybe another task."""
    q, a, follow = PLAIN_TASKS[rng.choice(tasks)](rng)
    turns = [(q, a)]
    if follow is not None and rng.random() < 0.35:
        turns.append(follow(rng))
    if rng.random() < 0.2:
        q2, a2, _ = PLAIN_TASKS[rng.choice(tasks)](rng)
        turns.append((q2, a2))
    return turns


# ---- tool-using flows ------------------------------------------------------------------

TOOLS = {
    "get_weather": {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "City name, e.g. Lisbon"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
            },
        },
    },
    "convert_currency": {
        "type": "function",
        "function": {
            "name": "convert_currency",
            "description": "Convert an amount of money between two currencies.",
            "parameters": {
                "type": "object",
                "properties": {
                    "amount": {"type": "number"},
                    "from_currency": {"type": "string", "description": "ISO code, e.g. USD"},
                    "to_currency": {"type": "string", "description": "ISO code, e.g. EUR"},
                },
                "required": ["amount", "from_currency", "to_currency"],
            },
        },
    },
    "calculate": {
        "type": "function",
        "function": {
            "name": "calculate",
            "description": "Evaluate an arithmetic expression exactly.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "description": "e.g. 12 * (3 + 4)"}},
                "required": ["expression"],
            },
        },
    },
    "create_reminder": {
        "type": "function",
        "function": {
            "name": "create_reminder",
            "description": "Create a reminder at a date and time.",
            "parameters": {
                "type": "object",
                "properties": {
                    "text": {"type": "string"},
                    "date": {"type": "string", "description": "YYYY-MM-DD"},
                    "time": {"type": "string", "description": "HH:MM, 24-hour clock"},
                },
                "required": ["text", "date", "time"],
            },
        },
    },
}


@dataclass
class ToolFlow:
    """One tool-using exchange: user asks, assistant calls tools, tools answer, assistant replies."""

    user: str
    calls: list[tuple[str, dict]]  # (function name, arguments)
    results: list[dict]
    answer: str
    tools: list[str] = field(default_factory=list)  # names offered to the model


def weather_flow(rng: random.Random) -> ToolFlow:
    unit = rng.choice(["celsius", "fahrenheit"])
    cities = rng.sample(CITIES, 2 if rng.random() < 0.3 else 1)
    results = []
    for city in cities:
        t = rng.randint(-5, 35)
        results.append({"city": city, "temperature": t if unit == "celsius" else round(t * 1.8 + 32),
                        "unit": unit, "condition": rng.choice(CONDITIONS),
                        "humidity": rng.randrange(20, 95, 5)})
    calls = [("get_weather", {"city": c, "unit": unit}) for c in cities]
    sentences = [f"In {r['city']} it is {r['temperature']} degrees {unit.capitalize()} and "
                 f"{r['condition']}, with {r['humidity']}% humidity." for r in results]
    if len(cities) == 1:
        user = rng.choice([f"What is the weather like in {cities[0]} right now, in {unit}?",
                           f"How warm is it in {cities[0]} today? Use {unit}."])
        tip = "Take an umbrella." if results[0]["condition"] in ("rainy", "snowy") else \
            "It looks like a fine day to be outside."
        answer = f"{sentences[0]} {tip}"
    else:
        user = f"Compare the weather in {cities[0]} and {cities[1]} right now, in {unit}."
        warmer = max(results, key=lambda r: r["temperature"])["city"]
        answer = f"{' '.join(sentences)} Right now {warmer} is the warmer of the two."
    return ToolFlow(user, calls, results, answer)


def currency_flow(rng: random.Random) -> ToolFlow:
    src, dst = rng.sample(sorted(CURRENCIES), 2)
    amount = rng.choice([10, 20, 25, 50, 75, 100, 150, 200, 250, 500, 1000])
    rate = RATES[dst] / RATES[src]
    converted = round(amount * rate, 2)
    user = rng.choice([f"How much is {amount} {src} in {dst}?",
                       f"Convert {amount} {CURRENCIES[src]} to {CURRENCIES[dst]}."])
    result = {"amount": amount, "from": src, "to": dst, "rate": round(rate, 4), "result": converted}
    answer = (f"{amount} {CURRENCIES[src]} is {fmt_num(converted)} {CURRENCIES[dst]} at a rate "
              f"of {round(rate, 4)} {dst} per {src}. Rates change during the day, so the final "
              f"amount at a bank may differ slightly.")
    return ToolFlow(user, [("convert_currency", {"amount": amount, "from_currency": src,
                                                 "to_currency": dst})], [result], answer)


def calculate_flow(rng: random.Random) -> ToolFlow:
    a, b, c = rng.randint(11, 99), rng.randint(11, 99), rng.randint(2, 12)
    expression = rng.choice([f"{a} * {b} + {c}", f"({a} + {b}) * {c}", f"{a} * {b} - {c}"])
    value = eval(expression)  # noqa: S307 - our own template, digits and + - * ( ) only
    user = rng.choice([f"Please calculate {expression}.", f"What is {expression} exactly?"])
    answer = (f"{expression} equals {value}. I used the calculator to get the exact result. "
              f"Let me know if you want the steps.")
    return ToolFlow(user, [("calculate", {"expression": expression})],
                    [{"expression": expression, "result": value}], answer)


def reminder_flow(rng: random.Random) -> ToolFlow:
    task = rng.choice(["call the dentist", "water the plants", "buy milk", "pay the rent",
                       "send the report", "book the train tickets", "pick up the parcel"])
    d = random_date(rng)
    time = f"{rng.randint(7, 20):02d}:{rng.choice(['00', '15', '30', '45'])}"
    user = f"Remind me to {task} on {fmt_date(d)} at {time}."
    result = {"status": "created", "id": f"rem-{rng.randrange(16**6):06x}", "text": task,
              "date": d.isoformat(), "time": time}
    answer = (f"Done. I created a reminder to {task} on {WEEKDAYS[d.weekday()]}, {fmt_date(d)} at "
              f"{time}. You will get a notification at that time.")
    return ToolFlow(user, [("create_reminder", {"text": task, "date": d.isoformat(), "time": time})],
                    [result], answer)


TOOL_FLOWS = [weather_flow, currency_flow, calculate_flow, reminder_flow]


def tool_flow(rng: random.Random) -> ToolFlow:
    flow = rng.choice(TOOL_FLOWS)(rng)
    offered = {name for name, _ in flow.calls}
    offered |= set(rng.sample(sorted(TOOLS), rng.randint(1, 3)))
    flow.tools = sorted(offered)
    return flow


def call_id(rng: random.Random) -> str:
    return f"call_{rng.randrange(16**8):08x}"


def openai_tool_record(rng: random.Random) -> dict:
    """OpenAI layout: `tools` + assistant `tool_calls` + `tool` messages (+ a closing turn)."""
    flow = tool_flow(rng)
    messages = [{"role": "system", "content": TOOL_SYSTEM_PROMPT}, {"role": "user", "content": flow.user}]
    ids = [call_id(rng) for _ in flow.calls]
    messages.append({
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": i, "type": "function",
                        "function": {"name": name, "arguments": json.dumps(args)}}
                       for i, (name, args) in zip(ids, flow.calls)],
    })
    for i, (name, _), result in zip(ids, flow.calls, flow.results):
        messages.append({"role": "tool", "tool_call_id": i, "name": name, "content": json.dumps(result)})
    messages.append({"role": "assistant", "content": flow.answer})
    if rng.random() < 0.3:
        # A follow-up that needs no tool: the assistant answers directly.
        q, a, _ = PLAIN_TASKS[rng.choice(["arithmetic", "conversion", "spelling"])](rng)
        messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    return {"messages": messages, "tools": [TOOLS[name] for name in flow.tools]}


def sharegpt_tool_record(rng: random.Random) -> dict:
    """ShareGPT layout with function calls (glaive-like): `tools` is a JSON string."""
    flow = tool_flow(rng)
    conv = [{"from": "system", "value": TOOL_SYSTEM_PROMPT}, {"from": "human", "value": flow.user}]
    for name, args in flow.calls:
        conv.append({"from": "function_call", "value": json.dumps({"name": name, "arguments": args})})
    for result in flow.results:
        conv.append({"from": "observation", "value": json.dumps(result)})
    conv.append({"from": "gpt", "value": flow.answer})
    return {"conversations": conv, "tools": json.dumps([TOOLS[name] for name in flow.tools])}


# ---- files -----------------------------------------------------------------------------


def maybe_system(rng: random.Random, p: float = 0.7) -> list[dict]:
    return [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}] if rng.random() < p else []


def openai_chat(rng: random.Random, tasks: list[str]) -> dict:
    messages = maybe_system(rng)
    for q, a in plain_turns(rng, tasks):
        messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    return {"messages": messages}


def sharegpt_chat(rng: random.Random, tasks: list[str]) -> dict:
    conv = [{"from": "system", "value": m["content"]} for m in maybe_system(rng, 0.4)]
    for q, a in plain_turns(rng, tasks):
        conv += [{"from": "human", "value": q}, {"from": "gpt", "value": a}]
    return {"conversations": conv}


def unique(make: Callable[[], dict], n: int, seen: set[str]) -> list[dict]:
    """n records from `make` whose user turns were not produced before (no duplicates,
    and no overlap between files or with the held-out prompts)."""
    out: list[dict] = []
    while len(out) < n:
        record = make()
        key = json.dumps(user_texts(record))
        if key in seen:
            continue
        seen.add(key)
        out.append(record)
    return out


def user_texts(record: dict) -> list[str]:
    if "messages" in record:
        return [m["content"] for m in record["messages"] if m["role"] == "user"]
    return [m["value"] for m in record["conversations"] if m["from"] == "human"]


def build(seed: int = SEED) -> dict[str, list]:
    """All sample datasets as Python objects (file stem -> records)."""
    rng = random.Random(seed)
    seen: set[str] = set()
    all_tasks = sorted(PLAIN_TASKS)

    def held_out_prompt() -> dict:
        q, _, _ = PLAIN_TASKS[rng.choice(all_tasks)](rng)
        return {"messages": [{"role": "user", "content": q}]}

    # Held-out prompts first, so no training file repeats one of them.
    held_out = unique(held_out_prompt, COUNTS["held_out"], seen)
    first_user = {user_texts(r)[0] for r in held_out}

    def not_held_out(make: Callable[[], dict]) -> Callable[[], dict]:
        def wrapped() -> dict:
            while True:
                record = make()
                if user_texts(record)[0] not in first_user:
                    return record
        return wrapped

    chat = unique(not_held_out(lambda: openai_chat(
        rng, ["arithmetic", "conversion", "dates", "spelling", "sorting"])), COUNTS["chat_openai"], seen)
    sharegpt = unique(not_held_out(lambda: sharegpt_chat(
        rng, ["recipes", "spelling", "dates", "arithmetic"])), COUNTS["sharegpt_plain"], seen)
    sharegpt += unique(lambda: sharegpt_tool_record(rng), COUNTS["sharegpt_tools"], seen)
    rng.shuffle(sharegpt)
    for i, record in enumerate(sharegpt):
        record["id"] = f"sample-{i:04d}"
    tools = unique(lambda: openai_tool_record(rng), COUNTS["tools"], seen)
    recipe_rows = unique(not_held_out(lambda: openai_chat(rng, ["recipes", "sorting"])),
                         COUNTS["recipes"], seen)
    prompts_only = unique(not_held_out(lambda: {"messages": maybe_system(rng, 0.5) + [
        {"role": "user", "content": PLAIN_TASKS[rng.choice(all_tasks)](rng)[0]}]}),
        COUNTS["prompts_only"], seen)
    return {"chat_openai": chat, "sharegpt": sharegpt, "tools": tools,
            "recipes": recipe_rows, "prompts_only": prompts_only,
            "prompts": [user_texts(r)[0] for r in held_out]}


def write_jsonl(path: Path, records: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")


def write_parquet(path: Path, records: list[dict]) -> None:
    """A Parquet table like many HF chat datasets: `messages` as list<struct<role, content>>
    plus a source id and a topic column that prepare ignores."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    message = pa.struct([("role", pa.string()), ("content", pa.string())])
    table = pa.table({
        "prompt_id": pa.array([f"recipes-{i:04d}" for i in range(len(records))]),
        "messages": pa.array([r["messages"] for r in records], type=pa.list_(message)),
        "num_turns": pa.array([sum(m["role"] == "user" for m in r["messages"]) for r in records],
                              type=pa.int32()),
    })
    pq.write_table(table, path, compression="zstd")


def write_all(out_dir: Path, seed: int = SEED) -> None:
    data = build(seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_jsonl(out_dir / "chat_openai.jsonl", data["chat_openai"])
    with open(out_dir / "sharegpt.json", "w", encoding="utf-8") as f:
        json.dump(data["sharegpt"], f, ensure_ascii=False, indent=1)
        f.write("\n")
    write_jsonl(out_dir / "tools.jsonl", data["tools"])
    write_parquet(out_dir / "recipes.parquet", data["recipes"])
    write_jsonl(out_dir / "prompts_only.jsonl", data["prompts_only"])
    (out_dir / "prompts.txt").write_text("\n".join(data["prompts"]) + "\n", encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT_DIR)
    parser.add_argument("--seed", type=int, default=SEED)
    args = parser.parse_args()
    write_all(args.out, args.seed)
    print(f"wrote the sample datasets to {args.out}")


if __name__ == "__main__":
    main()
