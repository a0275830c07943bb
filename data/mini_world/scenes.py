"""The mini world's pictures: seeded synthetic scenes drawn with PIL (one to three shapes of one kind and
colour, sometimes a digit or a short word), the facts they show, and the questions and answers about them.

A scene is a square RGB image of `size` pixels (a multiple of 28, so K2.5's rule keeps it as it is: no
resize, grid (1, size/14, size/14), size^2/784 `<|media_pad|>` rows). Shapes sit in the cells of a 2 x 2
grid, the text in a free cell; the text is drawn with a built-in 3 x 5 pixel font (scaled), not a system
font, so the pixels depend on nothing but Pillow's shape rasteriser and the seed.

Pure functions of a `random.Random`: the world builder draws its training pool and its held-out image
corpus from two different seeds.
"""
from __future__ import annotations

import io
import random
from dataclasses import dataclass
from typing import Optional

SHAPES = ("circle", "square", "triangle")
COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (230, 200, 30),
           "purple": (150, 50, 180), "orange": (240, 130, 20)}
WORDS = ("cat", "sun", "box", "hat", "dog", "map")
NUMBER_WORDS = ("zero", "one", "two", "three")
# 3 x 5 glyphs, rows top to bottom, '#' = ink: the digits and the letters of WORDS
GLYPHS = {
    "0": ("###", "#.#", "#.#", "#.#", "###"), "1": (".#.", "##.", ".#.", ".#.", "###"),
    "2": ("###", "..#", "###", "#..", "###"), "3": ("###", "..#", "###", "..#", "###"),
    "4": ("#.#", "#.#", "###", "..#", "..#"), "5": ("###", "#..", "###", "..#", "###"),
    "6": ("###", "#..", "###", "#.#", "###"), "7": ("###", "..#", ".#.", ".#.", ".#."),
    "8": ("###", "#.#", "###", "#.#", "###"), "9": ("###", "#.#", "###", "..#", "###"),
    "a": ("...", "##.", "..#", "###", "###"), "b": ("#..", "#..", "###", "#.#", "###"),
    "c": ("...", "###", "#..", "#..", "###"), "d": ("..#", "..#", "###", "#.#", "###"),
    "g": ("###", "#.#", "###", "..#", "##."), "h": ("#..", "#..", "###", "#.#", "#.#"),
    "m": ("...", "###", "###", "#.#", "#.#"), "n": ("...", "##.", "#.#", "#.#", "#.#"),
    "o": ("...", "###", "#.#", "#.#", "###"), "p": ("...", "###", "#.#", "###", "#.."),
    "s": ("...", "###", "##.", "..#", "###"), "t": (".#.", "###", ".#.", ".#.", ".##"),
    "u": ("...", "#.#", "#.#", "#.#", "###"), "x": ("...", "#.#", ".#.", "#.#", "#.#"),
}
QUESTIONS = {
    "caption": ("Describe the picture.", "What is in this image?", "Describe this image in one sentence."),
    "count": ("How many shapes are there?", "Count the shapes in the picture."),
    "colour": ("What colour are the shapes?", "Which colour do the shapes have?"),
    "shape": ("What shape do you see?", "Which kind of shape is drawn?"),
    "text": ("What is written in the picture?", "Read the text in the image."),
}


@dataclass(frozen=True)
class Scene:
    """What a picture shows; `text` is a digit, a word or None."""
    shape: str
    colour: str
    count: int
    text: Optional[str]
    cells: tuple[int, ...]  # the 2 x 2 grid cells (0..3, row-major) holding shapes, then the text's cell


def check_size(size: int) -> None:
    if size < 28 or size % 28:
        raise ValueError(f"scene size {size}: must be a multiple of 28 (>= 28), so K2.5's rule needs no resize")


def random_scene(rng: random.Random) -> Scene:
    count = rng.randint(1, 3)
    kind = rng.random()
    text = None if kind < 0.3 else (str(rng.randint(0, 9)) if kind < 0.65 else rng.choice(WORDS))
    cells = tuple(rng.sample(range(4), count + (text is not None)))
    return Scene(rng.choice(SHAPES), rng.choice(sorted(COLOURS)), count, text, cells)


def _cell_box(cell: int, size: int) -> tuple[int, int, int]:
    """(x0, y0, side) of a grid cell."""
    side = size // 2
    return (cell % 2) * side, (cell // 2) * side, side


def _draw_text(draw, text: str, x0: int, y0: int, side: int) -> None:
    scale = max(1, side // (4 * len(text) + 1))  # every glyph 3 wide + 1 gap
    width = (4 * len(text) - 1) * scale
    x = x0 + (side - width) // 2
    y = y0 + (side - 5 * scale) // 2
    for ch in text:
        for r, row in enumerate(GLYPHS[ch]):
            for c, ink in enumerate(row):
                if ink == "#":
                    draw.rectangle([x + c * scale, y + r * scale, x + (c + 1) * scale - 1, y + (r + 1) * scale - 1],
                                   fill=(0, 0, 0))
        x += 4 * scale


def draw_scene(scene: Scene, size: int):
    """The scene as a `size` x `size` PIL RGB image (white background)."""
    from PIL import Image, ImageDraw

    check_size(size)
    img = Image.new("RGB", (size, size), (255, 255, 255))
    draw = ImageDraw.Draw(img)
    fill = COLOURS[scene.colour]
    for cell in scene.cells[: scene.count]:
        x0, y0, side = _cell_box(cell, size)
        m = side // 6
        box = [x0 + m, y0 + m, x0 + side - m - 1, y0 + side - m - 1]
        if scene.shape == "circle":
            draw.ellipse(box, fill=fill)
        elif scene.shape == "square":
            draw.rectangle(box, fill=fill)
        else:
            draw.polygon([(box[0], box[3]), (box[2], box[3]), ((box[0] + box[2]) // 2, box[1])], fill=fill)
    if scene.text is not None:
        _draw_text(draw, scene.text, *_cell_box(scene.cells[scene.count], size))
    return img


def png(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG", optimize=False)
    return buf.getvalue()


def _noun(scene: Scene) -> str:
    return scene.shape if scene.count == 1 else f"{scene.shape}s"


def _text_phrase(scene: Scene) -> str:
    if scene.text is None:
        return ""
    return f" and the number {scene.text}" if scene.text.isdigit() else f" and the word {scene.text}"


def answer(scene: Scene, kind: str) -> str:
    """The true answer to a question of `kind` (a key of QUESTIONS)."""
    n = NUMBER_WORDS[scene.count]
    one = scene.count == 1
    if kind == "caption":
        return f"{n.capitalize()} {scene.colour} {_noun(scene)}{_text_phrase(scene)}."
    if kind == "count":
        return f"There is one {scene.shape}." if one else f"There are {n} {_noun(scene)}."
    if kind == "colour":
        return f"{'It is' if one else 'They are'} {scene.colour}."
    if kind == "shape":
        return f"I see {'a' if one else n} {_noun(scene)}."
    if kind == "text":
        if scene.text is None:
            return "Nothing is written."
        return f"The number {scene.text}." if scene.text.isdigit() else f"It says {scene.text}."
    raise ValueError(f"unknown question kind {kind!r}; one of {sorted(QUESTIONS)}")


def question_pairs(scene: Scene, rng: random.Random, turns: int) -> list[tuple[str, str]]:
    """`turns` (question, true answer) pairs about one scene, distinct kinds."""
    kinds = rng.sample(sorted(QUESTIONS), turns)
    return [(rng.choice(QUESTIONS[k]), answer(scene, k)) for k in kinds]
