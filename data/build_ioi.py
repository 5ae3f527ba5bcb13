"""Build data/pairs/ioi.jsonl, the shipped indirect-object-identification (IOI) pair set.

    python data/build_ioi.py [--tokenizer DIR] [--pairs N] [--seed S]

Each pair is a sentence in the style of Wang et al. (2022, "Interpretability in the Wild") and
MIB's IOI task: two people are introduced, one of them (the subject, S) is named again, and the
prompt ends where the other one (the indirect object, IO) comes next:

    clean    When Mary and John went to the store, John gave a drink to     -> " Mary" (IO)
    corrupt  When Mary and John went to the store, Mary gave a drink to     -> " John"

The corrupt prompt names the indirect object where the clean one names the subject the second
time (MIB's S2-IO flip counterfactual), so the two prompts line up token by token and differ at
one position; its answer is the clean prompt's subject. A study's logit difference is then the
indirect object's logit over the subject's, the metric of Wang et al. Both orders of the
introduction are made, half each: ABBA ("Mary and John ..., John ...") and BABA ("John and Mary
..., John ...").

Names, places and objects are this project's lists; a name is kept only if the tokenizer makes it
one token after a space (the tokenizer of smollm2-135m by default, the one the shipped file is
built for): the prompts of every pair then have the same length. Templates, names, places and
objects are written by this project (Apache-2.0, as patchgrid), after the pattern of Wang et al.'s
templates; no text is taken from their data set. The output is committed, so using the data needs
none of this.
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

OUT = Path(__file__).parent / "pairs" / "ioi.jsonl"

# {A} and {B} introduce the two people; {S} names the subject again; {P} a place, {O} an object.
TEMPLATES = (
    "When {A} and {B} went to the {P}, {S} gave a {O} to",
    "When {A} and {B} got to the {P}, {S} handed a {O} to",
    "After {A} and {B} arrived at the {P}, {S} gave a {O} to",
    "While {A} and {B} were at the {P}, {S} passed a {O} to",
    "Then, {A} and {B} went to the {P}. {S} gave a {O} to",
    "Then, {A} and {B} had a long day at the {P}. {S} gave a {O} to",
    "Later, {A} and {B} walked to the {P}, and {S} gave a {O} to",
    "Yesterday {A} and {B} met at the {P}, where {S} showed a {O} to",
    "Once {A} and {B} reached the {P}, {S} threw a {O} to",
    "As {A} and {B} left the {P}, {S} offered a {O} to",
    "{A} and {B} spent the morning at the {P}. Then {S} sent a {O} to",
    "At the {P}, {A} and {B} sat down, and {S} gave a {O} to",
)
NAMES = (
    "Mary", "John", "Tom", "Paul", "James", "David", "Sarah", "Anna", "Mark", "Laura", "Peter", "Lisa",
    "Michael", "Emma", "Daniel", "Kate", "Robert", "Alice", "George", "Rachel", "Steven", "Helen", "Adam",
    "Linda", "Chris", "Susan", "Brian", "Karen", "Kevin", "Emily", "Jason", "Amy", "Eric", "Jessica", "Ryan",
    "Julia", "Andrew", "Nancy", "Frank", "Grace", "Jack", "Ruth", "Henry", "Rose", "Sam", "Anne", "Matt",
    "Jane", "Joe", "Lucy", "Ben", "Sophie", "Tim", "Claire", "Max", "Diana", "Alex", "Kelly", "Charles",
    "Victoria", "Edward", "Maria", "Richard", "Patricia", "William", "Elizabeth", "Thomas", "Jennifer",
)
PLACES = ("store", "garden", "restaurant", "school", "hospital", "office", "station", "park", "market",
          "library", "beach", "house", "museum", "church", "airport", "hotel")
OBJECTS = ("drink", "ring", "book", "bone", "ball", "letter", "gift", "bag", "basket", "key", "snack",
           "necklace", "computer", "flower", "hat", "pen")


def one_token_names(tokenizer_dir: str | None) -> list[str]:
    """The names the tokenizer makes one token after a space (every name without a tokenizer)."""
    if tokenizer_dir is None:
        return list(NAMES)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    return [n for n in NAMES if len(tok(" " + n, add_special_tokens=False)["input_ids"]) == 1]


def make_pairs(names: list[str], n: int, seed: int) -> list[dict]:
    """`n` IOI pairs, half ABBA and half BABA, drawn with `seed`: names (two different ones),
    template, place and object chosen at random for each."""
    if len(names) < 2:
        raise SystemExit("IOI pairs need at least two one-token names; the tokenizer has fewer")
    rng = random.Random(seed)
    out = []
    for i in range(n):
        io, s = rng.sample(names, 2)
        order = "abba" if i % 2 == 0 else "baba"
        first, second = (io, s) if order == "abba" else (s, io)
        fill = dict(A=first, B=second, P=rng.choice(PLACES), O=rng.choice(OBJECTS))
        template = rng.choice(TEMPLATES)
        out.append({
            "pair_id": f"ioi-{i:04d}",
            "relation": f"ioi_{order}",
            "clean_prompt": template.format(S=s, **fill),
            "corrupt_prompt": template.format(S=io, **fill),
            "clean_answer": " " + io,
            "corrupt_answer": " " + s,
        })
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", default=None,
                    help="a tokenizer folder whose one-token names to keep (default: smollm2-135m's, built "
                         "by patchgrid.model.models; 'none': every name)")
    ap.add_argument("--pairs", type=int, default=400)
    ap.add_argument("--seed", type=int, default=2022)
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()
    tokenizer = args.tokenizer
    if tokenizer is None:
        from patchgrid.model.models import prepare

        tokenizer = str(prepare("smollm2-135m"))
    names = one_token_names(None if tokenizer == "none" else tokenizer)
    rows = make_pairs(names, args.pairs, args.seed)
    Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(rows)} IOI pairs over {len(names)} one-token names to {args.out}")


if __name__ == "__main__":
    main()
