"""A corpus of varied lines written for the tokenizer tests, and the tests that it is what it claims.

`corpus()` gives hand-written lines of every kind the tokenizers must agree on (English prose, code, numbers,
whitespace runs, tabs and newlines, CJK, emoji, combining marks, RTL text, ...) plus lines that mix them at
random (seeded, so every run sees the same corpus).
"""

from __future__ import annotations

import random
import unicodedata

PROSE = [
    "The quick brown fox jumps over the lazy dog.",
    "Once upon a time, there was a little girl named Lily who loved to play outside.",
    "I'm sure they'll say it's fine, don't you think? We've seen it; you'd agree.",
    "SHOUTING CONTRACTIONS: I'M, YOU'RE, THEY'VE, IT'S, WE'LL, HE'D",
    "The committee's report, published on Tuesday, was met with mixed reactions.",
    "She sells sea-shells by the sea-shore; the shells she sells are surely seashells.",
    "\"Quoted speech,\" he said, \"and 'nested quotes' inside it.\"",
    "Mr. Smith went to Washington, D.C., in Sept. 1998 (or so he claims).",
    "A well-known state-of-the-art model ran out-of-the-box.",
    "It was the best of times, it was the worst of times, it was the age of wisdom.",
    "Llamas are domesticated South American camelids, widely used as meat and pack animals.",
    "e.g. i.e. etc. vs. a.k.a. P.S. Ph.D. U.S.A.",
]
CODE = [
    "def foo(x):\n    return x ** 2  # square\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "SELECT * FROM users WHERE id = 42 AND name LIKE '%bob%';",
    '<html><body class="main">Hi &amp; bye</body></html>',
    '{"key": [1, 2, 3], "nested": {"a": null, "b": true}}',
    "https://example.com/path?q=1&r=two#frag",
    "snake_case_name camelCaseName kebab-case-name SCREAMING_CASE __dunder__",
    "if (a && b || !c) { return a ?? b; } else if (x >= 0x1F) {}",
    "#include <stdio.h>\nint main(void) { printf(\"%d\\n\", 42); }",
    "    indented four\n\tindented tab\n        indented eight",
    "x = [i for i in range(10) if i % 2 == 0]",
    "$ git commit -m 'fix: handle \\r\\n line endings' && git push",
    "fn main() -> Result<(), Box<dyn Error>> { Ok(()) }",
    "λx. x + 1 ≤ ∀y ∈ ℝ: y² ≥ 0 → ∑ᵢ aᵢ",
    "~~~ ``` ''' \"\"\" /// \\\\ || && ::",
]
NUMBERS = [
    "1", "12", "123", "1234", "12345", "123456789", "3.14159", "1,000,000", "2024-01-31", "10:30pm",
    "555-0199", "-42", "+7", "1e-9", "0xDEADBEEF", "½ ¼ ¾", "x² + y³", "٣٤٥", "४२", "ⅫⅣ", "１２３",
]
WHITESPACE = [" ", "  ", "   ", "\t", "\t\t", "\n", "\n\n", "\n\n\n", " \n", "\n ", "\r\n", " \t ", "    ", "\u00a0",
              "\u3000", "\u200b", "\u2003"]
WORLD = [
    "Café naïve résumé façade Ångström coöperate",
    "Äpfel und Birnen, Größe, Straße",
    "Россия и Україна, Беларусь",
    "Ελληνικά γράμματα και τόνοι",
    "你好，世界！这是一个测试。",
    "日本語のテキストとカタカナ ー ひらがな",
    "한국어 텍스트입니다",
    "ทดสอบภาษาไทย",
    "हिन्दी में लिखा पाठ",
    "Tiếng Việt có dấu: Cửa Việt",
    "ქართული ენა",
    "Հայերեն լեզու",
    "Ge'ez: ሰላም ዓለም",
]
RTL = [
    "مرحبا بالعالم",
    "שלום עולם",
    "فارسی: سلام دنیا",
    "اردو: ہیلو",
    "mixed English and עברית and العربية in one line",
    "\u202eright-to-left override\u202c",
]
EMOJI = [
    "😀", "👍🏽", "🇺🇸", "❤️", "🦙🦙🦙", "👨‍👩‍👧‍👦", "🏳️‍🌈", "✅", "🚀", "😶‍🌫️", "🤖💬", "🧑🏿‍💻", "☕", "🀄", "🫠",
]
COMBINING = [
    "e\u0301", "a\u0308", "n\u0303", "o\u0302\u0323", "Z\u0351\u036b\u0343\u036a\u0302\u036b\u033d\u034f\u0334",
    "\u0915\u094d\u0937", "\u1100\u1161\u11a8", "i\u0307", "\u0041\u030a", "c\u0327",
]
SPECIAL_LOOKING = [
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<s>", "</s>", "<unk>", "<bos>", "<eos>", "<start_of_turn>",
    "<end_of_turn>", "<think>", "<repo_name>", "[INST]", "<<SYS>>", "<0x41>", "▁", "Ġ", "Ċ",
]
POOLS = [PROSE, CODE, NUMBERS, WHITESPACE, WORLD, RTL, EMOJI, COMBINING]

# Lines that stand alone: edge cases worth naming.
FIXED = [
    "",
    " ",
    "   ",
    "\n",
    "\t",
    "\n\n\n",
    " \n \n",
    "a\n\n\nb",
    "Hello world",
    " Hello world",
    "Hello World!",
    "  leading and trailing spaces  ",
    "multiple   internal    spaces",
    "\t\ttabs\tand\nnewlines\r\nmixed",
    "   \n\n   indented\n\t\tblock",
    "zero\u200bwidth and\u00a0nbsp",
    "Punctuation!!! ??? ... --- (parens) [brackets] {braces}",
    "$100 + 20% = €120; #hashtag @mention",
    "<|im_start|> spelled in text <|im_end|>",
    "\u3000full width space\uff01",
    "\u0000nul and \u007fdel and \u001bescape",
    "\ufeffbyte order mark",
    "\U0010ffff\U000e0001 plane 16 and tags",
    "a" * 300,
    " " * 40 + "x",
    "ab" * 100,
    "1" * 50,
]


def _random_line(rng: random.Random) -> str:
    parts = []
    for _ in range(rng.randint(1, 6)):
        pool = rng.choice(POOLS + [SPECIAL_LOOKING] * (rng.random() < 0.1))
        parts.append(rng.choice(pool))
        parts.append(rng.choice([" ", " ", " ", "", "\t", "  ", "\n", ", ", ". "]))
    line = "".join(parts)
    r = rng.random()
    if r < 0.1:
        line = line.upper()
    elif r < 0.15:
        line = unicodedata.normalize("NFD", line)
    elif r < 0.2:
        line = " " + line
    elif r < 0.25:
        line = line.strip()
    return line


def corpus(n_random: int = 1000, seed: int = 20261122) -> list[str]:
    """FIXED + every pool's lines + n_random mixed lines, all distinct, in a fixed order."""
    rng = random.Random(seed)
    lines = list(dict.fromkeys(FIXED + [x for pool in [*POOLS, SPECIAL_LOOKING] for x in pool]))
    seen = set(lines)
    n_fixed = len(lines)
    while len(lines) < n_fixed + n_random:
        line = _random_line(rng)
        if line not in seen:
            seen.add(line)
            lines.append(line)
    return lines


def test_corpus_is_large_and_varied():
    lines = corpus()
    assert len(lines) >= 1000 and len(set(lines)) == len(lines)
    text = "".join(lines)
    for kind, pred in [
        ("CJK", lambda c: "\u4e00" <= c <= "\u9fff"),
        ("Hangul", lambda c: "\uac00" <= c <= "\ud7a3"),
        ("Arabic", lambda c: "\u0600" <= c <= "\u06ff"),
        ("Hebrew", lambda c: "\u0590" <= c <= "\u05ff"),
        ("emoji", lambda c: ord(c) >= 0x1F300),
        ("combining mark", lambda c: unicodedata.category(c) == "Mn"),
        ("tab", lambda c: c == "\t"),
        ("newline", lambda c: c == "\n"),
        ("digit", str.isdigit),
    ]:
        assert sum(map(pred, text)) >= 20, kind
    assert any("  " in x for x in lines) and any(x.startswith(" ") for x in lines)
    assert corpus() == lines  # seeded: the same corpus every run
