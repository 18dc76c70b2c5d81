"""The prompts the tests and benchmarks send the tiny models (their tokenizer knows the words)."""

PROMPTS = [
    "The weather today is",
    "My favourite food is",
    "Once upon a time, a little dog",
    "The train to the city leaves at",
    "In the garden we planted",
    "She opened the book and read",
    "The best way to learn is",
    "After school the children",
]
