"""LRA Pathfinder (32x32) and Path-X (128x128) images: a generator writing the LRA layout.

The task (Linsley et al. 2018; Kim et al. 2020, ICLR): an image holds two long "snakes" (contours
made of short dashes, the *paddles*), shorter distractor snakes, and two circle markers. Label 1:
the markers sit on the two ends of one snake; label 0: they sit on ends of different snakes.

Generator (our own code, written from the published algorithm in drewlinsley/pathfinder
``snakes2.py``; LRA's settings are in the docstrings of ``lra_benchmarks/data/pathfinder.py``):

- A snake is a chain of pivots p_0, p_1, ..., p_N on the pixel grid; step k goes from p_k to
  p_{k+1} = p_k + d_k with |d_k| ~ paddle_length + 2 * margin and draws one paddle of
  paddle_length centred in the step (a gap of ~margin on each side, so a snake reads as a dashed
  line). The first direction is uniform; afterwards direction j follows direction i with weight
  ``cos(min(|angle_j - angle_i| * continuity, pi/2))**2`` (the published continuity constraint:
  continuity 1.0 allows turns up to 90 degrees, 1.8 up to 50 degrees).
- Space is shared on the pixel grid (cell sets kept as Python-int bit sets). A step may be
  placed only if no cell within ``margin + 0.5`` pixels of its cells (the 4-connected
  "supercover" of the segment p_k -> p_{k+1}, gaps included) belongs to another snake or to an
  older step of its own snake, so snakes never cross, never touch, and never loop onto
  themselves; the padding border is a wall. A step is drawn from the turn weights restricted to
  the steps that fit; a snake with none left is stuck.
- The two target snakes start ``seed_distance`` apart near the image centre (the first at
  least ``2 * seed_distance`` from every border, as published) and grow alternately; if either
  gets stuck the pair is redrawn. Then ``num_distractor_snakes`` snakes of
  ``distractor_length`` paddles are added anywhere free (a stuck distractor is removed and
  retried up to 4 times, then skipped).
- Markers: discs of ``marker_radius`` at the origin tip (first paddle's start) of snake A and
  at the terminal tip (last paddle's end) of A (label 1) or of the other target snake (label 0).
- Drawing is anti-aliased: paddles and markers are drawn with pillow at ``antialias_scale``
  (4) times the resolution and box-downsampled (the published generator drew at 2x and resized
  with Lanczos); paddles are scaled by ``contrast`` and clipped to 1, markers are white.
- The per-image ``contour_mask`` (uint8 [H, W]: 0 background, 1 the snake carrying the first
  marker, 2 the other target snake, 3.. distractors) holds the supercover cells of every snake;
  different snakes are never 8-adjacent in it, so a flood fill from one marker reaches the other
  exactly when the label is 1.
- Labels are exactly balanced per batch (a shuffled half-and-half vector); every image has its
  own random stream (``image_rng``: Python's ``random.Random`` seeded with the string
  ``pathfinder/<seed>/<batch>/<index>``, of which only ``random()`` is used), so a seed fixes
  the bytes of every file.

Settings (LRA's Pathfinder32 / Pathfinder128 parameters; contour length = paddles per snake):

  resolution 32:  paddle length 2, margin 1, thickness 0.5, continuity 1.0, seed distance 7,
                  marker radius 1.5, padding 1, contrast 1.5 (2 x 0.75);
  resolution 128: paddle length 5, margin 2 or 3 (per image), thickness 1.5, continuity 1.8,
                  seed distance 20, marker radius 3, padding 1, contrast 0.9;
  difficulty easy / intermediate / hard: contour length 6 / 9 / 14 in the directories
  curv_baseline / curv_contour_length_9 / curv_contour_length_14; distractor length
  contour_length // 3 and (20 at 32 px, 35 at 128 px) // distractor_length distractor snakes.
  LRA's Pathfinder is 32 px hard; Path-X is 128 px hard.

On-disk layout (what LRA's TFDS builder and input pipeline read, and what the tasks
``pathfinder`` and ``pathx`` of ``lra_sparse.data.pathfinder`` read)::

  <output_dir>/<difficulty_dir>/imgs/<batch>/sample_<i>.png     8-bit grayscale, i per batch
  <output_dir>/<difficulty_dir>/metadata/<batch>.npy            text, despite the name

A metadata file has one line per image, space-separated, newline-terminated, in the published
generator's field order::

  imgs/<batch> sample_<i>.png <i> <label> <continuity> <contour_length> <distractor_length>
  <paddle_length> <paddle_thickness> <paddle_margin> <num_paddle_contrasts>

LRA reads fields 0 and 1 (the image path relative to the difficulty directory) and 3 (label).

Generator CLI (absl flags)::

  python -m lra_sparse.generators.pathfinder --output_dir=data/pathfinder32 --resolution=32 \\
      --difficulty=hard --num_images=200000 --seed=0 [--images_per_batch=1000] \\
      [--num_workers=1] [--grid=experiments/reports/pathfinder_samples.png] \\
      [--grid_rows=32:easy,32:intermediate,32:hard,128:hard] [--grid_columns=6]

  --output_dir        root of the layout above (the difficulty directory is created inside it;
                      it must not hold metadata files already)
  --resolution        32 (Pathfinder) or 128 (Path-X)
  --difficulty        easy | intermediate | hard
  --num_images        number of images (LRA: 200000 per difficulty: 160k/20k/20k)
  --seed              seed; the same seed (and images_per_batch) gives byte-identical files
  --images_per_batch  images per imgs/<batch> directory and metadata file (LRA: 1000)
  --num_workers       processes writing batches in parallel (the files do not change)
  --grid              also (or only, without --output_dir) draw a PNG grid of samples with
                      their labels, one row per entry of --grid_rows, --grid_columns per row

CPU demo sets: ``--output_dir=data/pathfinder_tiny --resolution=32 --difficulty=easy
--num_images=4000`` and ``--output_dir=data/pathx_tiny --resolution=128 --difficulty=easy
--num_images=600``.
"""
from __future__ import annotations

import bisect
import dataclasses
import functools
import math
import multiprocessing
import os
import random
import time
from typing import Sequence

from absl import app
from absl import flags
import numpy as np
from PIL import Image
from PIL import ImageChops
from PIL import ImageDraw

from lra_sparse import cli
from lra_sparse.data.pathfinder import DIFFICULTY_DIRS

CONTOUR_LENGTHS = {"easy": 6, "intermediate": 9, "hard": 14}
RESOLUTIONS = (32, 128)


# ---------------------------------------------------------------------------------------------
# Settings.

@dataclasses.dataclass(frozen=True)
class GeneratorSettings:
  """Everything that shapes an image (lengths in output pixels)."""
  resolution: int
  contour_length: int              # paddles per target snake
  distractor_length: int           # paddles per distractor snake
  num_distractor_snakes: int
  paddle_length: int
  paddle_margins: tuple[int, ...]  # one is drawn per image
  paddle_thickness: float
  continuity: float
  seed_distance: int
  marker_radius: float
  padding: int                     # border pixels no snake enters
  contrast: float                  # paddle intensity (clipped to 1 after anti-aliasing)
  antialias_scale: int
  max_distractor_retries: int = 4
  max_pair_attempts: int = 500     # redraws of the two target snakes before giving up


def settings_for(resolution: int, difficulty: str) -> GeneratorSettings:
  """LRA's generator settings for a resolution (32 or 128) and a difficulty."""
  if difficulty not in CONTOUR_LENGTHS:
    raise ValueError(f"unknown difficulty {difficulty!r}; expected one of "
                     f"{', '.join(CONTOUR_LENGTHS)}")
  contour_length = CONTOUR_LENGTHS[difficulty]
  distractor_length = contour_length // 3
  if resolution == 32:
    return GeneratorSettings(
        resolution=32, contour_length=contour_length, distractor_length=distractor_length,
        num_distractor_snakes=20 // distractor_length, paddle_length=2, paddle_margins=(1,),
        paddle_thickness=0.5, continuity=1.0, seed_distance=7, marker_radius=1.5, padding=1,
        contrast=1.5, antialias_scale=4)
  if resolution == 128:
    return GeneratorSettings(
        resolution=128, contour_length=contour_length, distractor_length=distractor_length,
        num_distractor_snakes=35 // distractor_length, paddle_length=5, paddle_margins=(2, 3),
        paddle_thickness=1.5, continuity=1.8, seed_distance=20, marker_radius=3.0, padding=1,
        contrast=0.9, antialias_scale=4)
  raise ValueError(f"unknown resolution {resolution!r}; expected one of {RESOLUTIONS}")


# ---------------------------------------------------------------------------------------------
# Step tables: every candidate step of one length, precomputed as flat offsets into a padded grid.

def _supercover(dy: int, dx: int) -> list[tuple[int, int]]:
  """4-connected cells met by the segment from cell centre (0, 0) to cell centre (dy, dx)."""
  n = int(math.ceil(math.hypot(dy, dx) * 64)) + 2
  t = np.linspace(0.0, 1.0, n)
  ys = np.floor(0.5 + t * dy).astype(np.int64)
  xs = np.floor(0.5 + t * dx).astype(np.int64)
  cells = set(zip(ys.tolist(), xs.tolist()))
  # Where both coordinates change between two samples the segment passes (near) a corner: add
  # both cells around it so the cells stay 4-connected (and the clearance test conservative).
  for i in np.flatnonzero((ys[1:] != ys[:-1]) & (xs[1:] != xs[:-1])).tolist():
    cells.add((int(ys[i + 1]), int(xs[i])))
    cells.add((int(ys[i]), int(xs[i + 1])))
  return sorted(cells)


def _disk(radius: float) -> np.ndarray:
  r = int(math.floor(radius))
  dy, dx = np.mgrid[-r:r + 1, -r:r + 1]
  keep = dy * dy + dx * dx <= radius * radius
  return np.stack([dy[keep], dx[keep]], axis=1)


def _bits(flat_indices: np.ndarray) -> int:
  """A Python int with bit i set for every i in ``flat_indices`` (non-negative)."""
  flags_ = np.zeros(int(flat_indices.max()) + 1, bool)
  flags_[flat_indices] = True
  return int.from_bytes(np.packbits(flags_, bitorder="little").tobytes(), "little")


def _options(weights: np.ndarray) -> tuple[tuple[int, ...], tuple[float, ...],
                                          tuple[float, ...]]:
  keep = np.flatnonzero(weights > 0)
  return (tuple(keep.tolist()), tuple(weights[keep].tolist()),
          tuple(np.cumsum(weights[keep]).tolist()))


@dataclasses.dataclass(frozen=True)
class _StepTable:
  """Candidate steps of one length on a grid padded by ``border`` wall cells on every side.

  Cell (y, x) of the padded grid has the flat index y * width + x. Sets of cells are Python
  ints used as bit sets: testing a step against everything placed so far is one shift and one
  AND, whatever the resolution.
  """
  width: int                                # padded grid side
  border: int
  base: int                                 # flat index of interior cell (0, 0)
  disp: tuple[tuple[int, int], ...]         # (dy, dx) of every candidate step
  disp_flat: tuple[int, ...]                # the same as flat offsets
  norm: tuple[float, ...]                   # |d|
  cell_offsets: tuple[tuple[int, ...], ...]  # flat offsets of each candidate's supercover cells
  cell_bits: tuple[int, ...]                # the same as bit sets, shifted by ``base``
  foot_bits: tuple[int, ...]                # cells within the clearance, shifted by ``base``
  window_bits: int                          # every bit a ``cell_bits`` entry may use
  # Per previous candidate: the candidates with a positive turn weight, their weights, and
  # the running sum of those; ``first`` the same for a snake's first step (uniform).
  turns: tuple[tuple[tuple[int, ...], tuple[float, ...], tuple[float, ...]], ...]
  first: tuple[tuple[int, ...], tuple[float, ...], tuple[float, ...]]
  wall_bits: int                            # cells within the clearance of a wall or padding


@functools.lru_cache(maxsize=None)
def _step_table(resolution: int, padding: int, step: int, clearance: float,
                continuity: float) -> _StepTable:
  border = step + int(math.ceil(clearance)) + 2
  width = resolution + 2 * border
  base = border * width + border
  # Integer displacements whose length rounds to the step length (~2 pi step of them).
  r = step + 1
  dy, dx = np.mgrid[-r:r + 1, -r:r + 1]
  keep = np.abs(np.hypot(dy, dx) - step) < 0.5
  disp = np.stack([dy[keep], dx[keep]], axis=1)
  angle = np.arctan2(disp[:, 0], disp[:, 1])
  order = np.argsort(angle, kind="stable")
  disp, angle = disp[order], angle[order]
  disk = _disk(clearance)
  cells, cell_bits, foot_bits = [], [], []
  for ddy, ddx in disp.tolist():
    cover = np.array(_supercover(ddy, ddx))
    flat = cover[:, 0] * width + cover[:, 1]
    cells.append(tuple(flat.tolist()))
    cell_bits.append(_bits(flat + base))
    dilated = np.unique((cover[:, None, :] + disk[None, :, :]).reshape(-1, 2), axis=0)
    foot_bits.append(_bits(dilated[:, 0] * width + dilated[:, 1] + base))
  delta = np.abs(angle[None, :] - angle[:, None])
  delta = np.minimum(delta, 2 * np.pi - delta) * continuity
  turn_weight = np.where(delta < np.pi / 2, np.cos(np.minimum(delta, np.pi / 2)) ** 2, 0.0)
  # Walls: the padding and everything outside the image, grown by the clearance.
  wall = np.ones((width, width), bool)
  lo, hi = border + padding, border + resolution - padding
  wall[lo:hi, lo:hi] = False
  pad = int(math.ceil(clearance))
  padded = np.pad(wall, pad, constant_values=True)
  near_wall = np.zeros_like(wall)
  for ddy, ddx in disk.tolist():
    near_wall |= padded[pad + ddy:pad + ddy + width, pad + ddx:pad + ddx + width]
  return _StepTable(
      width=width, border=border, base=base, disp=tuple(map(tuple, disp.tolist())),
      disp_flat=tuple((disp[:, 0] * width + disp[:, 1]).tolist()),
      norm=tuple(np.hypot(disp[:, 0], disp[:, 1]).tolist()), cell_offsets=tuple(cells),
      cell_bits=tuple(cell_bits), foot_bits=tuple(foot_bits),
      window_bits=(1 << max(b.bit_length() for b in cell_bits)) - 1,
      turns=tuple(_options(w) for w in turn_weight), first=_options(np.ones(len(disp))),
      wall_bits=_bits(np.flatnonzero(near_wall.reshape(-1))))


# ---------------------------------------------------------------------------------------------
# Layout: snakes on the occupancy grid.

_REJECTION_TRIES = 4   # weighted draws checked one by one before every candidate is checked


class _Layout:
  """The snakes placed so far (pivots as flat grid indices) and the cells they block.

  A step blocks the cells within the clearance of its supercover cells. A candidate step fits
  when none of its own cells is blocked by a step other than its snake's previous step (the
  two share the pivot cell): the same as "no foreign cell within the clearance of it", as the
  clearance disk is symmetric. ``blocked`` holds the walls and every step except the newest
  step of each snake; ``newest[s]`` the newest step of snake s.
  """

  def __init__(self, table: _StepTable, rng: random.Random):
    self.table = table
    self.random = rng.random
    self.reset()

  def reset(self) -> None:
    self.blocked = self.table.wall_bits
    self.newest: list[int] = []
    self.snakes: list[list[int]] = []        # per snake: pivots (flat)
    self.snake_steps: list[list[int]] = []   # per snake: candidate index of every step

  def blocked_for(self, snake: int) -> int:
    blocked = self.blocked
    for other, bits in enumerate(self.newest):
      if other != snake:
        blocked |= bits
    return blocked

  def is_free(self, cell: int) -> bool:
    return not (self.blocked_for(-1) >> cell) & 1

  def new_snake(self, pivot: int) -> int:
    self.snakes.append([pivot])
    self.snake_steps.append([])
    self.newest.append(0)
    return len(self.snakes) - 1

  def extend(self, snake: int) -> bool:
    """Adds one step to ``snake``; False if no candidate step fits.

    The step is drawn from the turn weights restricted to the candidates that fit: first by
    rejection (draw, check, redraw), then, if that keeps failing, from the exact restricted
    distribution; both give the same distribution.
    """
    t = self.table
    pivots, steps = self.snakes[snake], self.snake_steps[snake]
    pivot = pivots[-1]
    blocked = self.blocked
    for other, bits in enumerate(self.newest):
      if bits and other != snake:
        blocked |= bits
    # Bit o + base of ``window`` is cell pivot + o: candidates test small ints only.
    shift = pivot - t.base
    window = (blocked >> shift) & t.window_bits
    cell_bits = t.cell_bits
    options, weights, cdf = t.turns[steps[-1]] if steps else t.first
    total = cdf[-1]
    last = len(cdf) - 1
    rand, bisect_right = self.random, bisect.bisect_right
    for _ in range(_REJECTION_TRIES):
      k = bisect_right(cdf, rand() * total)
      chosen = options[k if k <= last else last]  # k > last only if rounding gave ``total``
      if not cell_bits[chosen] & window:
        break
    else:
      fitting, cumulative, acc = [], [], 0.0
      for j, weight in zip(options, weights):
        if not cell_bits[j] & window:
          acc += weight
          fitting.append(j)
          cumulative.append(acc)
      if not fitting:
        return False
      k = bisect_right(cumulative, rand() * acc)
      chosen = fitting[k if k < len(fitting) else -1]
    self.blocked |= self.newest[snake]
    self.newest[snake] = t.foot_bits[chosen] << shift
    steps.append(chosen)
    pivots.append(pivot + t.disp_flat[chosen])
    return True

  def snapshot(self) -> tuple[int, int]:
    return self.blocked, len(self.snakes)

  def restore(self, state: tuple[int, int]) -> None:
    """Drops the snakes added since ``snapshot`` (a distractor that got stuck)."""
    self.blocked, num = state
    del self.snakes[num:], self.snake_steps[num:], self.newest[num:]

  def random_interior_cell(self, lo: int, hi: int) -> int:
    b, span = self.table.border, hi - lo
    y = lo + min(int(self.random() * span), span - 1)
    x = lo + min(int(self.random() * span), span - 1)
    return (y + b) * self.table.width + (x + b)

  def cell_yx(self, flat: int) -> tuple[int, int]:
    y, x = divmod(flat, self.table.width)
    return y - self.table.border, x - self.table.border

  def contour_mask(self, order: Sequence[int], size: int) -> np.ndarray:
    """uint8 [size, size]: 1 + the position in ``order`` of the snake covering each cell."""
    t = self.table
    cells, ids = [], []
    for mask_id, snake in enumerate(order, start=1):
      for pivot, j in zip(self.snakes[snake], self.snake_steps[snake]):
        cells.extend(pivot + o for o in t.cell_offsets[j])
        ids.extend([mask_id] * len(t.cell_offsets[j]))
    mask = np.zeros(t.width * t.width, np.uint8)
    mask[np.array(cells, np.int64)] = np.array(ids, np.uint8)
    b = t.border
    return mask.reshape(t.width, t.width)[b:b + size, b:b + size].copy()


# ---------------------------------------------------------------------------------------------
# Samples.

@dataclasses.dataclass
class PathfinderSample:
  image: np.ndarray          # uint8 [H, W]
  label: int                 # 1: the markers are on one snake
  contour_mask: np.ndarray   # uint8 [H, W]: 0 none, 1 marked snake, 2 other target, 3.. distractors
  marker_cells: np.ndarray   # int [2, 2]: (row, col) of the pixel under each marker centre
  snakes: list[np.ndarray]   # per mask id - 1: pivot centres [steps + 1, 2] (row, col), float
  paddle_margin: int


def _place_target_pair(layout: _Layout, settings: GeneratorSettings) -> None:
  res, sd = settings.resolution, settings.seed_distance
  lo = max(min(2 * sd, res // 2 - 1), settings.padding)
  hi = max(res - lo, lo + 1)
  t = layout.table
  for _ in range(settings.max_pair_attempts):
    layout.reset()
    first = layout.new_snake(layout.random_interior_cell(lo, hi))
    if not layout.extend(first):
      continue
    y0, x0 = layout.cell_yx(layout.snakes[first][0])
    second_seed = -1
    for _ in range(10):
      phi = layout.random() * 2 * math.pi
      y, x = int(round(y0 + sd * math.sin(phi))), int(round(x0 + sd * math.cos(phi)))
      flat = (y + t.border) * t.width + x + t.border
      if settings.padding <= min(y, x) and max(y, x) < res - settings.padding \
          and layout.is_free(flat):
        second_seed = flat
        break
    if second_seed < 0:
      continue
    second = layout.new_snake(second_seed)
    if not layout.extend(second):
      continue
    grown = True
    for _ in range(settings.contour_length - 1):
      if not (layout.extend(first) and layout.extend(second)):
        grown = False
        break
    if grown:
      return
  raise RuntimeError(f"could not place two snakes of {settings.contour_length} paddles in "
                     f"{settings.max_pair_attempts} attempts ({settings})")


def _place_distractors(layout: _Layout, settings: GeneratorSettings) -> None:
  res, pad = settings.resolution, settings.padding
  # The target snakes are complete: their newest steps block every distractor.
  layout.blocked = layout.blocked_for(-1)
  layout.newest = [0] * len(layout.newest)
  for _ in range(settings.num_distractor_snakes):
    for _ in range(settings.max_distractor_retries + 1):
      seed = -1
      for _ in range(20):
        cell = layout.random_interior_cell(pad, res - pad)
        if layout.is_free(cell):
          seed = cell
          break
      if seed < 0:
        break
      state = layout.snapshot()
      snake = layout.new_snake(seed)
      if all(layout.extend(snake) for _ in range(settings.distractor_length)):
        layout.blocked |= layout.newest[snake]
        layout.newest[snake] = 0
        break
      layout.restore(state)


def _paddle_ends(layout: _Layout, snake: int, settings: GeneratorSettings
                 ) -> list[tuple[float, float, float, float]]:
  """(row0, col0, row1, col1) of every paddle of a snake in continuous pixel coordinates."""
  t = layout.table
  length = settings.paddle_length
  ends = []
  for pivot, j in zip(layout.snakes[snake], layout.snake_steps[snake]):
    y, x = layout.cell_yx(pivot)
    (dy, dx), norm = t.disp[j], t.norm[j]
    gap = (norm - length) / 2                 # the paddle is centred in its step
    a, b = gap / norm, (gap + length) / norm
    ends.append((y + 0.5 + a * dy, x + 0.5 + a * dx, y + 0.5 + b * dy, x + 0.5 + b * dx))
  return ends


@functools.lru_cache(maxsize=None)
def _contrast_table(contrast: float) -> tuple[int, ...]:
  """Pillow ``point`` table: coverage byte -> min(255, round(coverage * contrast))."""
  return tuple(min(255, int(round(v * contrast))) for v in range(256))


def _render(paddles: Sequence[tuple[float, float, float, float]],
            markers: Sequence[tuple[float, float]], settings: GeneratorSettings) -> Image.Image:
  """8-bit grayscale image: paddles and marker discs drawn ``antialias_scale`` times finer and
  box-filtered down (pillow's ``reduce``); paddles scaled by the contrast, markers at full."""
  size, s = settings.resolution, settings.antialias_scale
  lines = Image.new("L", (size * s, size * s), 0)
  draw = ImageDraw.Draw(lines)
  width = max(1, int(round(settings.paddle_thickness * s)))
  for y0, x0, y1, x1 in paddles:
    # Pixel i of the fine canvas covers [i, i + 1) / s; pillow addresses its centre as i.
    draw.line([(x0 * s - 0.5, y0 * s - 0.5), (x1 * s - 0.5, y1 * s - 0.5)], fill=255,
              width=width)
  dots = Image.new("L", (size * s, size * s), 0)
  draw = ImageDraw.Draw(dots)
  r = settings.marker_radius * s
  for cy, cx in markers:
    cy, cx = cy * s - 0.5, cx * s - 0.5
    draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=255)
  paddle_layer = lines.reduce(s).point(_contrast_table(settings.contrast))
  return ImageChops.lighter(paddle_layer, dots.reduce(s))


def image_rng(seed: int, batch: int, index: int) -> random.Random:
  """The random stream of image ``index`` of batch ``batch`` (Python's Mersenne Twister)."""
  return random.Random(f"pathfinder/{seed}/{batch}/{index}")


def _draw_layout(settings: GeneratorSettings, label: int, rng: random.Random
                 ) -> tuple[_Layout, list[int], int, Image.Image, tuple[tuple[float, float], ...]]:
  """Places the snakes and draws the image: (layout, snake order, margin, image, markers)."""
  if label not in (0, 1):
    raise ValueError(f"label must be 0 or 1, got {label!r}")
  margins = settings.paddle_margins
  margin = margins[min(int(rng.random() * len(margins)), len(margins) - 1)]
  table = _step_table(settings.resolution, settings.padding,
                      settings.paddle_length + 2 * margin, margin + 0.5, settings.continuity)
  layout = _Layout(table, rng)
  _place_target_pair(layout, settings)
  _place_distractors(layout, settings)

  marked = 1 if rng.random() < 0.5 else 0   # snake A carries the origin marker
  order = [marked, 1 - marked] + list(range(2, len(layout.snakes)))
  paddles = [_paddle_ends(layout, snake, settings) for snake in order]
  origin = paddles[0][0][:2]                 # the start of snake A's first paddle
  terminal = paddles[0 if label == 1 else 1][-1][2:]   # the end of a last paddle
  image = _render([p for snake in paddles for p in snake], (origin, terminal), settings)
  return layout, order, margin, image, (origin, terminal)


def generate_sample(settings: GeneratorSettings, label: int,
                    rng: random.Random) -> PathfinderSample:
  """One image with the given label, drawn from ``rng`` (only ``rng.random()`` is used)."""
  layout, order, margin, image, markers = _draw_layout(settings, label, rng)
  pixels = np.frombuffer(image.tobytes(), np.uint8).reshape(settings.resolution, -1)
  # Mask ids follow ``order``: 1 = snake A, 2 = the other target snake, 3.. distractors.
  mask = layout.contour_mask(order, settings.resolution)
  snakes = [np.array([[y + 0.5, x + 0.5] for y, x in map(layout.cell_yx, layout.snakes[s])])
            for s in order]
  return PathfinderSample(image=pixels, label=label, contour_mask=mask,
                          marker_cells=np.floor(np.array(markers)).astype(np.int64),
                          snakes=snakes, paddle_margin=margin)


def batch_labels(seed: int, batch: int, num: int) -> np.ndarray:
  """Exactly balanced labels of one batch (an odd last one is a coin flip), shuffled."""
  rng = np.random.default_rng([seed, batch, 0])
  labels = np.zeros(num, np.int64)
  labels[:num // 2] = 1
  if num % 2:
    labels[-1] = rng.integers(2)
  rng.shuffle(labels)
  return labels


def generate_batch(settings: GeneratorSettings, seed: int, batch: int, num: int
                   ) -> list[PathfinderSample]:
  """The ``num`` images of batch ``batch`` (what ``write_dataset`` writes to imgs/<batch>)."""
  labels = batch_labels(seed, batch, num)
  return [generate_sample(settings, int(labels[i]), image_rng(seed, batch, i))
          for i in range(num)]


def _write_batch(job: tuple[str, int, str, int, int, int]) -> tuple[int, int, float]:
  """Writes imgs/<batch>/*.png and metadata/<batch>.npy: (images, label-1 count, CPU s)."""
  root, resolution, difficulty, seed, batch, num = job
  start_cpu = time.process_time()
  settings = settings_for(resolution, difficulty)
  subdir = f"imgs/{batch}"
  os.makedirs(os.path.join(root, subdir), exist_ok=True)
  labels = batch_labels(seed, batch, num)
  rows = []
  for i in range(num):
    label = int(labels[i])
    # The same image generate_sample() returns, without its mask and geometry.
    _, _, margin, image, _ = _draw_layout(settings, label, image_rng(seed, batch, i))
    name = f"sample_{i}.png"
    image.save(os.path.join(root, subdir, name), format="PNG")
    rows.append(f"{subdir} {name} {i} {label} {settings.continuity} "
                f"{settings.contour_length} {settings.distractor_length} "
                f"{settings.paddle_length} {settings.paddle_thickness} {margin} 1\n")
  with open(os.path.join(root, "metadata", f"{batch}.npy"), "w", encoding="utf-8") as f:
    f.writelines(rows)
  return num, int(labels.sum()), time.process_time() - start_cpu


def write_dataset(output_dir: str, resolution: int, difficulty: str, num_images: int,
                  seed: int = 0, images_per_batch: int = 1000, progress: bool = True,
                  num_workers: int = 1) -> str:
  """Writes the LRA layout under ``output_dir/<difficulty_dir>``; returns that directory.

  Batches are independent, so ``num_workers`` processes write the same bytes as one.
  """
  settings_for(resolution, difficulty)      # validates both
  if num_images < 1:
    raise ValueError(f"num_images must be >= 1, got {num_images}")
  if images_per_batch < 1:
    raise ValueError(f"images_per_batch must be >= 1, got {images_per_batch}")
  if num_workers < 1:
    raise ValueError(f"num_workers must be >= 1, got {num_workers}")
  root = os.path.join(output_dir, DIFFICULTY_DIRS[difficulty])
  metadata_dir = os.path.join(root, "metadata")
  if os.path.isdir(metadata_dir) and os.listdir(metadata_dir):
    raise ValueError(f"{metadata_dir} already holds metadata files; delete {root} or pick "
                     f"another --output_dir (stale batches would be read with the new ones)")
  os.makedirs(metadata_dir, exist_ok=True)
  jobs = [(root, resolution, difficulty, seed, batch,
           min(images_per_batch, num_images - batch * images_per_batch))
          for batch in range(-(-num_images // images_per_batch))]
  start = time.perf_counter()
  done = positives = 0
  cpu = 0.0
  # A spawned worker imports this module again (under multiprocessing's own name for the main
  # module when this file is the program, so that _write_batch unpickles there). Its top level
  # only defines things: no task registration, no flags, so that import is harmless; a forked
  # worker inherits the module as it is.
  pool = multiprocessing.get_context("spawn").Pool(num_workers) if num_workers > 1 else None
  try:
    results = pool.imap_unordered(_write_batch, jobs) if pool else map(_write_batch, jobs)
    for finished, (num, ones, seconds) in enumerate(results, start=1):
      done, positives, cpu = done + num, positives + ones, cpu + seconds
      if progress:
        elapsed = time.perf_counter() - start
        print(f"{root}: batch {finished}/{len(jobs)}, {done} images, "
              f"{done / max(elapsed, 1e-9):.0f} images/s", flush=True)
  finally:
    if pool:
      pool.close()
      pool.join()
  elapsed = time.perf_counter() - start
  if progress:
    print(f"wrote {num_images} images ({positives} with label 1, "
          f"{positives / num_images:.1%}) to {root} in {elapsed:.1f} s with {num_workers} "
          f"process(es): {num_images / max(elapsed, 1e-9):.0f} images/s; "
          f"{num_images / max(cpu, 1e-9):.0f} images per CPU second")
  return root


# ---------------------------------------------------------------------------------------------
# Sample grid for people.

_SNAKE_COLOURS = np.array([[1.0, 1.0, 1.0],    # no snake (markers)
                           [1.0, 0.25, 0.2],   # 1: the snake with the first marker
                           [0.2, 0.6, 1.0],    # 2: the other target snake
                           [0.55, 0.55, 0.55]])  # 3..: distractors


def colour_by_snake(sample: PathfinderSample, marker_radius: float) -> np.ndarray:
  """float RGB [H, W, 3]: the image's ink tinted by the snake it belongs to (the nearest mask
  cell within one pixel), markers white."""
  ids = np.minimum(sample.contour_mask.astype(np.int64), 3)
  # Ink spills up to a pixel beyond its mask cells: give each pixel the largest id around it
  # (ids of different snakes are never within a pixel of each other).
  padded = np.pad(ids, 1)
  size = ids.shape[0]
  near = np.max([padded[1 + dy:1 + dy + size, 1 + dx:1 + dx + size]
                 for dy in (-1, 0, 1) for dx in (-1, 0, 1)], axis=0)
  near = np.where(ids > 0, ids, near)
  yy, xx = np.mgrid[0:size, 0:size]
  for y, x in sample.marker_cells:
    near[np.hypot(yy - y, xx - x) <= marker_radius + 1] = 0
  return sample.image[..., None] / 255.0 * _SNAKE_COLOURS[near]


def draw_sample_grid(path: str, rows: Sequence[tuple[int, str]], columns: int = 6,
                     seed: int = 0, coloured: int = 2) -> None:
  """A PNG grid: per (resolution, difficulty) row, ``columns - coloured`` samples (labels
  alternating 1, 0) and then the first ``coloured`` of them again, tinted by snake."""
  import matplotlib                                            # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt                              # pylint: disable=g-import-not-at-top

  plain = columns - coloured
  if plain < 1 or coloured < 0 or coloured > plain:
    raise ValueError(f"need 0 <= coloured ({coloured}) <= columns - coloured ({plain})")
  fig, axes = plt.subplots(len(rows), columns, figsize=(2.0 * columns, 2.2 * len(rows) + 0.6),
                           squeeze=False)
  for r, (resolution, difficulty) in enumerate(rows):
    settings = settings_for(resolution, difficulty)
    samples = [generate_sample(settings, 1 - c % 2, random.Random(f"grid/{seed}/{r}/{c}"))
               for c in range(plain)]
    for c in range(columns):
      sample = samples[c if c < plain else c - plain]
      ax = axes[r, c]
      if c < plain:
        ax.imshow(sample.image, cmap="gray", vmin=0, vmax=255, interpolation="nearest")
        ax.set_title(f"label {sample.label}", fontsize=10)
      else:
        ax.imshow(colour_by_snake(sample, settings.marker_radius), interpolation="nearest")
        ax.set_title(f"label {sample.label}, by snake", fontsize=10)
      ax.set_xticks([])
      ax.set_yticks([])
      if c == 0:
        ax.set_ylabel(f"{resolution}x{resolution} {difficulty}\n{DIFFICULTY_DIRS[difficulty]}\n"
                      f"{settings.contour_length} + {settings.num_distractor_snakes}x"
                      f"{settings.distractor_length} paddles", fontsize=9)
  fig.suptitle("Pathfinder samples. Label 1: the two circles are the two ends of one dashed "
               "contour; label 0: ends of two different contours.\nLast columns: the first "
               "samples of the row again, marked contour red, other long contour blue, "
               "distractors gray.", fontsize=10)
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path, dpi=100)
  plt.close(fig)


# ---------------------------------------------------------------------------------------------
# CLI.

def _define_flags() -> None:
  flags.DEFINE_string("output_dir", None, "Root of the LRA layout (difficulty dir inside).")
  flags.DEFINE_enum("resolution", "32", ["32", "128"], "Image side: 32 (Pathfinder) or 128 "
                    "(Path-X).")
  flags.DEFINE_enum("difficulty", "hard", list(DIFFICULTY_DIRS), "Contour length 6/9/14.")
  flags.DEFINE_integer("num_images", 200000, "Number of images.")
  flags.DEFINE_integer("seed", 0, "Seed of every image's random stream.")
  flags.DEFINE_integer("images_per_batch", 1000, "Images per imgs/<batch> and metadata file.")
  flags.DEFINE_integer("num_workers", 1, "Processes writing batches (same bytes as 1).")
  flags.DEFINE_string("grid", None, "Also draw a PNG grid of samples with their labels here.")
  flags.DEFINE_string("grid_rows", "32:easy,32:intermediate,32:hard,128:hard",
                      "Comma-separated resolution:difficulty, one grid row each.")
  flags.DEFINE_integer("grid_columns", 6, "Samples per grid row.")


def _parse_grid_rows(text: str) -> list[tuple[int, str]]:
  rows = []
  for item in text.split(","):
    parts = item.strip().split(":")
    if len(parts) != 2 or not parts[0].isdigit():
      raise app.UsageError(f"--grid_rows: expected resolution:difficulty, got {item!r}")
    settings_for(int(parts[0]), parts[1])   # validates both
    rows.append((int(parts[0]), parts[1]))
  return rows


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  f = flags.FLAGS
  if not f.output_dir and not f.grid:
    raise app.UsageError("give --output_dir (write a data set) and/or --grid (draw samples)")
  if f.output_dir:
    write_dataset(f.output_dir, int(f.resolution), f.difficulty, f.num_images, f.seed,
                  f.images_per_batch, num_workers=f.num_workers)
  if f.grid:
    draw_sample_grid(f.grid, _parse_grid_rows(f.grid_rows), f.grid_columns, f.seed)
    print(f"wrote {f.grid}")


# Flags are defined only when this file is the program: tests import several generators (and
# the trainer) into one process, and their flag names (--output_dir, --seed, ...) overlap.
if __name__ == "__main__":
  _define_flags()
  cli.run(main)
