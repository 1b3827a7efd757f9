"""mpidl.data_tools: input formats, patches, splits, converters, the command line, errors.

Every input file is written by the tests themselves in tmp_path: MATLAB v5 (scipy.io.savemat),
MATLAB v7.3 (HDF5 with MATLAB's transposed layout, written with h5py), .npy, image folders.
"""

from __future__ import annotations

import os
import subprocess
import sys

import h5py
import numpy as np
import pytest
import scipy.io

from mpidl.data.layout import read_split_arrays, validate_layout
from mpidl.data_tools.__main__ import main
from mpidl.data_tools.hsi import convert_hsi, extract_patches, pixels_to_image
from scene_checks import roughness
from mpidl.data.layout import channel_stats
from mpidl.data_tools.sources import ArrayFile, InputError, clean_name, parse_source
from mpidl.data_tools.splits import block_split, random_split

ROWS, COLS, BANDS = 6, 5, 3  # not square, so a mixed-up pixel order cannot go unnoticed


def position_cube(rows=ROWS, cols=COLS, bands=BANDS) -> np.ndarray:
    """cube[r, c, b] = 100 r + 10 c + b: every value says where it came from."""
    r, c, b = np.meshgrid(np.arange(rows), np.arange(cols), np.arange(bands), indexing="ij")
    return (100.0 * r + 10.0 * c + b).astype(np.float64)


def class_map(rows=ROWS, cols=COLS) -> np.ndarray:
    """Labels 1..3 in vertical stripes, some pixels unlabelled (0)."""
    m = np.tile(1 + (np.arange(cols) * 3) // cols, (rows, 1))
    m[0, 0] = 0
    m[rows - 1, 2] = 0
    return m.astype(np.uint8)


def to_fortran_pixels(image: np.ndarray) -> np.ndarray:
    """(rows, cols, d) -> (d, pixels) with pixels numbered column by column, as MATLAB does."""
    rows, cols, d = image.shape
    return image.transpose(2, 1, 0).reshape(d, cols * rows)


def save_v73(path, variables: dict) -> None:
    """A MATLAB v7.3 file as MATLAB writes it: an HDF5 file behind a 512-byte header, every array
    stored transposed (column-major), a MATLAB_class attribute on each variable, text as uint16
    code units, and cell arrays of strings as object references into '#refs#'."""
    with h5py.File(path, "w", userblock_size=512) as f:
        refs = f.create_group("#refs#")
        for name, value in variables.items():
            if isinstance(value, list):  # a cell array of strings, (n, 1) in MATLAB
                ds = f.create_dataset(name, shape=(1, len(value)), dtype=h5py.ref_dtype)
                for i, text in enumerate(value):
                    codes = np.array([[ord(ch)] for ch in text], dtype=np.uint16)  # 1 x len in MATLAB
                    item = refs.create_dataset(f"s{name}{i}", data=codes)
                    item.attrs["MATLAB_class"] = np.bytes_("char")
                    ds[0, i] = item.ref
                ds.attrs["MATLAB_class"] = np.bytes_("cell")
            else:
                arr = np.asarray(value, dtype=np.float64)
                arr = arr.reshape(1, 1) if arr.ndim == 0 else arr
                ds = f.create_dataset(name, data=arr.T)  # MATLAB is column-major: HDF5 sees A.T
                ds.attrs["MATLAB_class"] = np.bytes_("double")
    with open(path, "r+b") as fh:
        fh.write(b"MATLAB 7.3 MAT-file, Platform: GLNXA64, written by the mpidl tests".ljust(128))


def read_split(path, split):
    """Raw (x, y, pos) of either layout variant (the converter writes the smaller one)."""
    return read_split_arrays(path, split)


def only_inputs_left(folder, inputs) -> bool:
    return sorted(os.listdir(folder)) == sorted(inputs)


# ---------------------------------------------------------------------------------------------
# sources
# ---------------------------------------------------------------------------------------------
def test_parse_source_and_clean_name():
    assert parse_source("a/b.mat:Y") == ("a/b.mat", "Y")
    assert parse_source("a/b.mat") == ("a/b.mat", None)
    assert parse_source("dir:x/b.mat") == ("dir:x/b.mat", None)
    assert [clean_name(n) for n in ("1-rock", "2-Tree", " 3_water ", "Asphalt")] == \
        ["rock", "tree", "water", "asphalt"]


def test_v73_reader_undoes_matlabs_transpose(tmp_path):
    cube = position_cube()
    save_v73(tmp_path / "c.mat", {"cube": cube, "names": ["1-a", "2-bb"], "n": 7})
    source = ArrayFile(tmp_path / "c.mat")
    assert source.format == "mat73"
    assert source.variables["cube"].shape == (ROWS, COLS, BANDS)
    np.testing.assert_array_equal(source.load("cube"), cube)
    assert source.load("names") == ["1-a", "2-bb"]
    assert source.pick(None) == "cube"  # the largest 2-D/3-D numeric variable


def test_v5_reader_and_key_choice(tmp_path):
    scipy.io.savemat(tmp_path / "c.mat", {"Y": np.ones((3, 30)), "M": np.ones((3, 2)),
                                          "cood": np.array([["x"], ["y"]], dtype=object)})
    source = ArrayFile(tmp_path / "c.mat")
    assert source.format == "mat5" and source.pick(None) == "Y"
    assert source.load("cood") == ["x", "y"]


# ---------------------------------------------------------------------------------------------
# patches and pixel order
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("pad_mode", ["reflect", "constant", "edge"])
@pytest.mark.parametrize("patch", [1, 3, 5])
def test_patches_match_a_padded_scene_at_every_pixel(pad_mode, patch):
    cube = position_cube()
    half = patch // 2
    padded = np.pad(cube, ((half, half), (half, half), (0, 0)), mode=pad_mode)
    positions = np.argwhere(np.ones((ROWS, COLS), bool))
    out = extract_patches(cube, positions, patch, pad_mode)
    assert out.shape == (ROWS * COLS, BANDS, patch, patch) and out.dtype == np.float32
    for (r, c), p in zip(positions, out):
        np.testing.assert_array_equal(p, padded[r:r + patch, c:c + patch].transpose(2, 0, 1))
        np.testing.assert_array_equal(p[:, half, half], cube[r, c])  # the pixel is the centre


def test_corner_patch_values():
    cube = position_cube()
    zero = extract_patches(cube, np.array([[0, 0]]), 3, "constant")[0, 0]
    np.testing.assert_array_equal(zero, [[0, 0, 0], [0, 0, 10], [0, 100, 110]])
    mirror = extract_patches(cube, np.array([[0, 0]]), 3, "reflect")[0, 0]
    np.testing.assert_array_equal(mirror, [[110, 100, 110], [10, 0, 10], [110, 100, 110]])
    edge = extract_patches(cube, np.array([[0, 0]]), 3, "edge")[0, 0]
    np.testing.assert_array_equal(edge, [[0, 0, 10], [0, 0, 10], [100, 100, 110]])


def test_fortran_pixel_order_gives_a_smooth_image():
    rows, cols = 12, 9
    rr, cc = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
    image = np.sin(rr / 3.0) + np.cos(cc / 4.0)
    pixels = to_fortran_pixels(image[:, :, None]).T  # (pixels, 1)
    np.testing.assert_array_equal(pixels_to_image(pixels, rows, cols, "F")[:, :, 0], image)
    wrong = pixels_to_image(pixels, rows, cols, "C")[:, :, 0]
    assert roughness(image) < 0.5 * roughness(wrong)


# ---------------------------------------------------------------------------------------------
# conversions: each input format round-trips to patches centred on the right pixels
# ---------------------------------------------------------------------------------------------
def check_conversion(out, cube, labels_image, names, patch):
    """Every labelled pixel appears exactly once over train+test, with the right label and a
    patch centred on it; unlabelled pixels do not appear."""
    meta = validate_layout(out)
    assert meta["class_names"] == names and meta["patch_size"] == patch
    seen = []
    half = patch // 2
    for split in ("train", "test"):
        x, y, pos = read_split(out, split)
        assert x.shape[1:] == (cube.shape[2], patch, patch)
        np.testing.assert_array_equal(x[:, :, half, half], cube[pos[:, 0], pos[:, 1]])
        np.testing.assert_array_equal(y, labels_image[pos[:, 0], pos[:, 1]])
        seen += [tuple(p) for p in pos]
    assert sorted(seen) == sorted(map(tuple, np.argwhere(labels_image >= 0)))
    assert len(set(seen)) == len(seen)
    return meta


def test_v5_cube_with_class_map(tmp_path):
    cube, cmap = position_cube(), class_map()
    scipy.io.savemat(tmp_path / "cube.mat", {"img": cube})
    scipy.io.savemat(tmp_path / "gt.mat", {"gt": cmap})
    out = tmp_path / "out.h5"
    result = convert_hsi(str(tmp_path / "cube.mat"), out, labels=str(tmp_path / "gt.mat"),
                         patch=3, train_fraction=0.5, seed=1)
    check_conversion(out, cube, cmap.astype(int) - 1, ["class1", "class2", "class3"], 3)
    assert "class1" in result.table and "total" in result.table


def test_v73_matrix_in_fortran_order_with_abundances_and_cood(tmp_path):
    cube = position_cube()
    rng = np.random.default_rng(0)
    abund = rng.dirichlet(np.ones(3), size=(ROWS, COLS))  # (rows, cols, 3)
    save_v73(tmp_path / "scene.mat", {"Y": to_fortran_pixels(cube), "nRow": ROWS, "nCol": COLS})
    save_v73(tmp_path / "end.mat", {"A": to_fortran_pixels(abund), "M": np.ones((BANDS, 3)),
                                    "cood": ["1-Rock", "2-Tree", "3-Water"]})
    out = tmp_path / "out.h5"
    convert_hsi(str(tmp_path / "scene.mat"), out, abundances=str(tmp_path / "end.mat"),
                patch=5, pad_mode="edge", train_fraction=0.4)
    check_conversion(out, cube, abund.argmax(axis=2), ["rock", "tree", "water"], 5)


def test_min_abundance_leaves_mixed_pixels_unlabelled(tmp_path):
    cube = position_cube()
    abund = np.random.default_rng(1).dirichlet(np.ones(2) * 0.7, size=(ROWS, COLS))
    np.save(tmp_path / "cube.npy", cube)
    np.save(tmp_path / "abund.npy", abund)
    out = tmp_path / "out.h5"
    result = convert_hsi(str(tmp_path / "cube.npy"), out, abundances=str(tmp_path / "abund.npy"),
                         min_abundance=0.7, patch=3, train_fraction=0.5,
                         class_names=["wet", "dry"])
    expected = np.where(abund.max(axis=2) >= 0.7, abund.argmax(axis=2), -1)
    check_conversion(out, cube, expected, ["wet", "dry"], 3)
    assert "left unlabelled" in result.report()


def test_npy_matrix_with_rows_and_cols_and_c_order(tmp_path):
    cube, cmap = position_cube(), class_map()
    np.save(tmp_path / "y.npy", cube.reshape(ROWS * COLS, BANDS).T)  # (bands, pixels), C order
    np.save(tmp_path / "gt.npy", cmap.reshape(-1))  # a pixel vector, C order
    out = tmp_path / "out.h5"
    convert_hsi(str(tmp_path / "y.npy"), out, labels=str(tmp_path / "gt.npy"), rows=ROWS,
                cols=COLS, pixel_order="C", patch=3, train_per_class=2)
    check_conversion(out, cube, cmap.astype(int) - 1, ["class1", "class2", "class3"], 3)
    _, y, _ = read_split(out, "train")
    assert np.bincount(y).tolist() == [2, 2, 2]


def test_statistics_are_those_of_the_training_split(tmp_path):
    cube, cmap = position_cube(), class_map()
    np.save(tmp_path / "cube.npy", cube)
    np.save(tmp_path / "gt.npy", cmap)
    out = tmp_path / "out.h5"
    convert_hsi(str(tmp_path / "cube.npy"), out, labels=str(tmp_path / "gt.npy"), patch=3)
    meta = validate_layout(out)
    x_train, _, _ = read_split(out, "train")
    x_all = np.concatenate([x_train, read_split(out, "test")[0]])
    mean, std = channel_stats(x_train)
    np.testing.assert_allclose(meta["mean"], mean)
    np.testing.assert_allclose(meta["std"], std)
    assert not np.allclose(meta["mean"], channel_stats(x_all)[0])


# ---------------------------------------------------------------------------------------------
# splits
# ---------------------------------------------------------------------------------------------
def test_random_split_fractions_and_per_class_counts():
    labels = np.repeat([0, 1, 2], [10, 25, 7])
    names = ["a", "b", "c"]
    train, test = random_split(labels, names, seed=3, train_fraction=0.3)
    assert np.bincount(labels[train]).tolist() == [3, 8, 2]  # floor(0.3 n + 1/2)
    assert sorted(np.concatenate([train, test]).tolist()) == list(range(labels.size))
    again = random_split(labels, names, seed=3, train_fraction=0.3)
    np.testing.assert_array_equal(again[0], train)
    assert not np.array_equal(random_split(labels, names, seed=4, train_fraction=0.3)[0], train)
    train, test = random_split(labels, names, seed=0, train_per_class=5)
    assert np.bincount(labels[train]).tolist() == [5, 5, 5]
    assert np.bincount(labels[test]).tolist() == [5, 20, 2]
    # tiny classes keep one sample on each side
    train, _ = random_split(np.array([0, 0, 1, 1, 1]), ["x", "y"], train_fraction=0.01)
    assert np.bincount(np.array([0, 0, 1, 1, 1])[train]).tolist() == [1, 1]


def test_block_split_is_spatially_disjoint():
    rows = cols = 32
    rr, cc = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
    image = ((np.sin(rr / 5.0) + np.cos(cc / 7.0)) > 0).astype(int) + 2 * (rr > 20)
    positions = np.argwhere(np.ones((rows, cols), bool))
    labels = image.reshape(-1)
    names = ["a", "b", "c", "d"]
    train, test = block_split(labels, positions, names, block_size=4, seed=0, train_fraction=0.5)
    assert sorted(np.concatenate([train, test]).tolist()) == list(range(labels.size))
    train_blocks = {tuple(p) for p in positions[train] // 4}
    test_blocks = {tuple(p) for p in positions[test] // 4}
    assert train_blocks.isdisjoint(test_blocks)
    fraction = np.bincount(labels[train], minlength=4) / np.bincount(labels, minlength=4)
    assert np.all((fraction > 0.2) & (fraction < 0.8)), fraction


def test_block_split_in_the_converter(tmp_path):
    rows = cols = 24
    rr, cc = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
    cmap = 1 + ((rr // 6 + cc // 6) % 3)
    np.save(tmp_path / "cube.npy", position_cube(rows, cols, 2))
    np.save(tmp_path / "gt.npy", cmap)
    out = tmp_path / "out.h5"
    convert_hsi(str(tmp_path / "cube.npy"), out, labels=str(tmp_path / "gt.npy"), patch=3,
                split="blocks", block_size=4, train_fraction=0.5)
    _, _, pos_train = read_split(out, "train")
    _, _, pos_test = read_split(out, "test")
    assert {tuple(p) for p in pos_train // 4}.isdisjoint({tuple(p) for p in pos_test // 4})


# ---------------------------------------------------------------------------------------------
# errors: a clear message naming the file and the problem, and no output file
# ---------------------------------------------------------------------------------------------
@pytest.fixture()
def inputs(tmp_path):
    cube, cmap = position_cube(), class_map()
    scipy.io.savemat(tmp_path / "cube.mat", {"img": cube})
    scipy.io.savemat(tmp_path / "gt.mat", {"gt": cmap})
    scipy.io.savemat(tmp_path / "small.mat", {"gt": cmap[:3, :3]})
    lonely = cmap.copy()
    lonely[2, 2] = 4  # class 4 has one pixel
    scipy.io.savemat(tmp_path / "lonely.mat", {"gt": lonely})
    scipy.io.savemat(tmp_path / "twins.mat", {"a": cube, "b": cube + 1})
    (tmp_path / "junk.mat").write_bytes(b"\x00garbage, not a MAT-file" * 10)
    return tmp_path


ERRORS = [
    ("missing key", dict(cube="cube.mat:NOPE", labels="gt.mat"), InputError,
     r"no variable 'NOPE' \(variables: img", "cube.mat"),
    ("sizes differ", dict(cube="cube.mat", labels="small.mat"), InputError,
     r"ground truth 'gt' has shape \(3, 3\) but the cube .*cube.mat:img is 6 x 5 pixels", "small.mat"),
    ("even patch", dict(cube="cube.mat", labels="gt.mat", patch=4), ValueError,
     "--patch must be an odd positive size", None),
    ("fraction 0", dict(cube="cube.mat", labels="gt.mat", train_fraction=0.0), ValueError,
     r"--train-fraction must be in \(0, 1\), got 0.0", None),
    ("fraction 1", dict(cube="cube.mat", labels="gt.mat", train_fraction=1.0), ValueError,
     r"--train-fraction must be in \(0, 1\)", None),
    ("fraction 1.5", dict(cube="cube.mat", labels="gt.mat", train_fraction=1.5), ValueError,
     r"--train-fraction must be in \(0, 1\)", None),
    ("too few pixels", dict(cube="cube.mat", labels="lonely.mat"), ValueError,
     "class 'class4' has 1 labelled sample.*needs at least 2", None),
    ("per class too many", dict(cube="cube.mat", labels="gt.mat", train_per_class=9), ValueError,
     "--train-per-class 9 needs at least 10", None),
    ("not a mat file", dict(cube="junk.mat", labels="gt.mat"), InputError,
     "cannot read as a MATLAB .mat file", "junk.mat"),
    ("missing file", dict(cube="nothere.mat", labels="gt.mat"), FileNotFoundError,
     "no such file", "nothere.mat"),
    ("ambiguous key", dict(cube="twins.mat", labels="gt.mat"), InputError,
     "equally large; name one with FILE:KEY", "twins.mat"),
    ("no ground truth", dict(cube="cube.mat"), ValueError, "exactly one ground truth", None),
    ("blocks too big", dict(cube="cube.mat", labels="gt.mat", split="blocks", block_size=64),
     ValueError, "use a smaller --block-size", None),
    ("bad pad mode", dict(cube="cube.mat", labels="gt.mat", pad_mode="wrap"), ValueError,
     "--pad-mode must be one of", None),
    ("names count", dict(cube="cube.mat", labels="gt.mat", class_names=["a"]), ValueError,
     "--class-names lists 1 names but .*gt.mat:gt has 3 classes", None),
]


@pytest.mark.parametrize("what, kwargs, error, message, names_file", ERRORS,
                         ids=[e[0] for e in ERRORS])
def test_conversion_errors(inputs, what, kwargs, error, message, names_file):
    before = sorted(os.listdir(inputs))
    kwargs = dict(kwargs)
    for key in ("cube", "labels"):
        if key in kwargs:
            kwargs[key] = str(inputs / kwargs[key])
    with pytest.raises(error, match=message) as info:
        convert_hsi(out=inputs / "out.h5", **kwargs)
    if names_file:
        assert names_file in str(info.value)
    assert only_inputs_left(inputs, before)  # no output, no temporary file


# ---------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------
def test_cli_hsi_and_info(inputs, capsys):
    out = inputs / "out.h5"
    rc = main(["hsi", "--cube", str(inputs / "cube.mat"), "--labels", str(inputs / "gt.mat"),
               "--patch", "3", "--train-fraction", "0.5", "--class-names", "x,y,z",
               "--out", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0
    assert "class    train     test" in printed and "\nx " in printed and "wrote" in printed
    assert main(["info", str(out), "--verify"]) == 0
    printed = capsys.readouterr().out
    assert "train mean" in printed and "verified" in printed and "pad_mode" in printed


def test_cli_errors_exit_1_with_the_message(inputs, capsys):
    out = inputs / "out.h5"
    rc = main(["hsi", "--cube", str(inputs / "cube.mat") + ":NOPE", "--labels",
               str(inputs / "gt.mat"), "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 1 and err.startswith("error: ") and "cube.mat" in err and "NOPE" in err
    assert not out.exists()
    assert main(["info", str(inputs / "junk.mat")]) == 1
    assert "not an HDF5 file" in capsys.readouterr().err


def test_info_refuses_a_file_with_wrong_statistics(inputs, capsys):
    out = inputs / "s.h5"
    assert main(["synthetic", "--rows", "12", "--cols", "12", "--bands", "4", "--patch", "3",
                 "--train-fraction", "0.5",
                 "--out", str(out)]) == 0
    capsys.readouterr()
    with h5py.File(out, "r+") as f:
        f.attrs["mean"] = f.attrs["mean"] + 1.0
    assert main(["info", str(out)]) == 0  # structurally valid
    assert main(["info", str(out), "--verify"]) == 1
    assert "not the training split's statistics" in capsys.readouterr().err


def test_module_entry_point(tmp_path):
    bad = tmp_path / "bad.h5"
    bad.write_text("nope")
    proc = subprocess.run([sys.executable, "-m", "mpidl.data_tools", "info", str(bad)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "bad.h5: not an HDF5 file" in proc.stderr


def test_synthetic_cli_writes_a_valid_layout(tmp_path, capsys):
    out = tmp_path / "syn.h5"
    assert main(["synthetic", "--rows", "16", "--cols", "16", "--bands", "6", "--classes", "3",
                 "--patch", "5", "--train-fraction", "0.25", "--out", str(out)]) == 0
    assert "meadow" in capsys.readouterr().out
    meta = validate_layout(out)
    assert meta["sample_shape"] == (6, 5, 5) and meta["num_classes"] == 3
    assert meta["splits"]["train"] + meta["splits"]["test"] == 256
    assert main(["synthetic", "--train-fraction", "2", "--out", str(tmp_path / "x.h5")]) == 1
    assert not (tmp_path / "x.h5").exists()


# ---------------------------------------------------------------------------------------------
# images
# ---------------------------------------------------------------------------------------------
@pytest.fixture()
def image_folder(tmp_path):
    image_module = pytest.importorskip("PIL.Image")
    root = tmp_path / "imgs"
    rng = np.random.default_rng(0)
    for k, name in enumerate(["cats", "dogs"]):
        (root / name).mkdir(parents=True)
        for i in range(4):
            size = (10 + i, 7 + k)  # different sizes: all get resized
            pixels = rng.integers(0, 256, size=(size[1], size[0], 3), dtype=np.uint8)
            suffix = ".png" if i % 2 == 0 else ".jpg"
            image_module.fromarray(pixels).save(root / name / f"{i}{suffix}")
    (root / "dogs" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n this is not an image")
    (root / "dogs" / "readme.txt").write_text("not an image, ignored")
    return root


def test_images_skip_bad_ones_and_count_them(image_folder, tmp_path):
    from mpidl.data_tools.images import convert_images

    out = tmp_path / "imgs.h5"
    result = convert_images(str(image_folder), out, size=8, train_per_class=2, seed=0)
    assert result.skipped == [os.path.join("dogs", "broken.png")]
    assert "skipped 1 image(s)" in result.report()
    meta = validate_layout(out)
    assert meta["class_names"] == ["cats", "dogs"] and meta["sample_shape"] == (3, 8, 8)
    assert meta["splits"] == {"train": 4, "test": 4}
    with h5py.File(out, "r") as f:
        x = f["train/x"][...]
        assert "pos" not in f["train"]  # images have no position in a scene
    assert x.min() >= 0 and x.max() <= 1


def test_images_error_mode_names_the_file(image_folder, tmp_path):
    from mpidl.data_tools.images import convert_images

    out = tmp_path / "imgs.h5"
    with pytest.raises(InputError, match=r"broken.png: cannot decode image"):
        convert_images(str(image_folder), out, size=8, on_bad_image="error")
    assert not out.exists()
    rc = main(["images", "--folder", str(image_folder), "--size", "8", "--on-bad-image", "error",
               "--out", str(out)])
    assert rc == 1 and not out.exists()


def test_images_class_with_too_few_images(image_folder, tmp_path):
    from mpidl.data_tools.images import convert_images

    (image_folder / "birds").mkdir()
    src = next((image_folder / "cats").glob("*.png"))
    (image_folder / "birds" / "one.png").write_bytes(src.read_bytes())
    with pytest.raises(ValueError, match="class 'birds' has 1 labelled sample"):
        convert_images(str(image_folder), tmp_path / "o.h5", size=8)
    assert not (tmp_path / "o.h5").exists()


def test_images_without_pillow_say_how_to_install(tmp_path, monkeypatch):
    from mpidl.data_tools import images

    monkeypatch.setitem(sys.modules, "PIL", None)  # makes `import PIL` fail
    monkeypatch.setitem(sys.modules, "PIL.Image", None)
    with pytest.raises(ImportError, match=r"needs Pillow.*pip install 'mpidl\[images\]'"):
        images.convert_images(str(tmp_path), tmp_path / "o.h5")
    assert main(["images", "--folder", str(tmp_path), "--out", str(tmp_path / "o.h5")]) == 1
    assert not (tmp_path / "o.h5").exists()


def test_info_refuses_what_training_refuses_with_the_same_words(tmp_path, capsys):
    """Before: ``info`` printed a file with an empty test split (exit 0) that ``mpidl.train``
    refuses (exit 2). Both now call mpidl.data.layout.check_trainable."""
    from mpidl.data.layout import write_layout

    x = np.zeros((8, 2, 3, 3), np.float32)
    y = np.arange(8) % 2
    path = tmp_path / "no_test.h5"
    write_layout(path, {"train": (x, y), "test": (x[:0], y[:0])}, ["a", "b"])
    problem = ("the test split is empty (0 samples): there is nothing to evaluate the model on (convert the "
               "data with a test split)")
    assert main(["info", str(path)]) == 1
    assert capsys.readouterr().err == f"error: {path}: {problem}\n"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-m", "mpidl.train", "--data", str(path), "--epochs", "1"], cwd=root,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr == f"error: --data {path}: {problem}\n"
