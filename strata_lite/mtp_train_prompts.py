"""Coding requests whose greedy answers become MTP training text (`train-mtp --answers`, mtp_train_answers).

Written for this project (no benchmark's text): everyday programming tasks, each asked in four ways (Python
with edge cases, JavaScript with an explanation, another language, Python with tests), so the answers
cover the code, prose and markdown a coding model writes while serving. prompts() lists them in a fixed
order; which ones are held out is decided by mtp_train_data.split_held_out, like the text files.
"""
from __future__ import annotations

TASKS = (
    "checks whether a string is a palindrome, ignoring case, spaces and punctuation",
    "merges two sorted lists into one sorted list without using a built-in sort",
    "parses one line of CSV in which fields may be quoted and contain commas",
    "computes the edit distance between two strings",
    "flattens an arbitrarily nested list of lists",
    "groups a list of words into sets of anagrams",
    "returns the n most frequent words of a text, ignoring case",
    "validates a dotted-quad IPv4 address",
    "converts a Roman numeral to an integer",
    "spells out an integer below one million in English words",
    "finds the longest common prefix of a list of strings",
    "performs binary search on a sorted array and returns the index or -1",
    "rotates a square matrix by 90 degrees clockwise in place",
    "detects whether a singly linked list has a cycle",
    "implements an LRU cache with get and put in constant time",
    "keeps the running median of a stream of numbers",
    "parses a duration such as 1h30m15s into a number of seconds",
    "splits a list into chunks of at most n items",
    "removes duplicates from a list while keeping the first occurrence of each item",
    "sorts the nodes of a dependency graph topologically and reports a cycle if there is one",
    "finds the shortest path between two cells of a grid with walls, using breadth-first search",
    "computes shortest distances from one node of a weighted graph with Dijkstra's algorithm",
    "retries a failing call with exponential backoff and a maximum number of attempts",
    "loads a JSON configuration file and fills in default values for missing keys",
    "walks a directory tree and prints the ten largest files",
    "implements a token-bucket rate limiter",
    "escapes the HTML special characters of a string",
    "converts snake_case identifiers to camelCase and back",
    "checks whether the brackets (), [] and {} in a string are balanced",
    "evaluates an arithmetic expression with +, -, *, / and parentheses without eval",
    "generates all permutations of a list",
    "lists the prime numbers below n with the sieve of Eratosthenes",
    "multiplies two matrices given as lists of rows",
    "implements a queue with two stacks",
    "implements a trie with insert and prefix search",
    "run-length encodes and decodes a string",
    "formats a number of bytes as a human-readable size such as 1.5 MiB",
    "counts the lines of each log level (INFO, WARNING, ERROR) in a large log file without reading it whole",
    "debounces a function so that it runs only after calls have stopped for a given delay",
    "implements a binary min-heap with push and pop",
    "computes the moving average of a sequence over a fixed window",
    "implements union-find with path compression and union by rank",
    "checks whether a filled 9x9 sudoku grid is valid",
    "wraps a paragraph of text to a given line width without breaking words",
    "parses the query string of a URL into a dictionary of lists",
    "merges overlapping intervals in a list of (start, end) pairs",
    "finds two numbers in an array that add up to a target, in linear time",
    "serializes a binary tree to a string and deserializes it again",
    "computes the number of days between two dates given as YYYY-MM-DD strings",
    "downloads a web page with a timeout and reports HTTP errors clearly",
    "implements a counter that many threads can increment safely",
    "runs a producer and two consumers connected by a bounded queue",
    "memoizes a function of hashable arguments with a decorator",
    "compares two version strings such as 1.10.2 and 1.9",
    "prints a list of records as a table with aligned columns",
    "finds the k-th largest element of an unsorted array",
    "encodes bytes as base64 without a library",
    "reverses a singly linked list iteratively and recursively",
    "reads a CSV file of sales and prints the total per month",
    "validates a password against length, digit and symbol rules and says which rule failed",
)

OTHER_LANGUAGES = ("Go", "Rust", "TypeScript", "Java", "C++", "C#")


def _framings(i: int, task: str) -> list[str]:
    lang = OTHER_LANGUAGES[i % len(OTHER_LANGUAGES)]
    return [f"Write Python code that {task}. Include a docstring and handle edge cases.",
            f"Write JavaScript code that {task}, and explain briefly how it works.",
            f"Implement this in idiomatic {lang}: code that {task}.",
            f"Write Python code that {task}, then write a few pytest tests for it."]


def prompts() -> list[str]:
    """Every prompt (len(TASKS) * 4), in rounds: round r asks every task once, task i in framing
    (i + r) % 4, so the first N prompts spread over all tasks and framings alike (`--answers N`)."""
    return [_framings(i, task)[(i + r) % 4] for r in range(4) for i, task in enumerate(TASKS)]
