"""The pytest plugin: the ``device`` fixture, ``--devices``, ``--devicectx-accelerator`` and the
``requires_device`` marker.

Registered with the ``pytest11`` entry point, so it is active wherever devicectx is installed
(``pytest -p no:devicectx`` turns it off). A test session that does not use it is not changed:
tests that do not take a ``device`` argument are left alone, and the machine's devices are
looked up only when some test asks for them.

Example (a test module)::

    import pytest
    import torch

    def test_ones(device):  # runs as test_ones[cpu], test_ones[cuda:0], ...
        assert torch.ones(2, device=device).device == device

    @pytest.mark.requires_device("cuda")
    def test_on_gpu():  # skipped, with the reason, where there is no CUDA device
        ...

    @pytest.mark.requires_device("accelerator")
    def test_streams():  # any accelerator torch.accelerator reports: CUDA, MPS, XPU, emu
        ...

Run it on chosen devices with ``pytest --devices=cpu,meta``; on a machine without a GPU, add
an accelerator with ``pytest --devicectx-accelerator=emulated`` (``emu:0`` and ``emu:1``,
see :mod:`devicectx.testing.emulated`), enabled before collection so that the ``device``
fixture includes its devices; ``--devicectx-accelerator=emulated:mps`` plays an MPS-like
device (a profile of ``emulated.PROFILES``) and ``--devicectx-emulated-devices=4`` gives more
devices.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pytest

# torch and devicectx's device code are imported only inside the hooks that need them: this
# module is loaded into every pytest session wherever devicectx is installed.
if TYPE_CHECKING:
    import torch

_FIXTURE = "device"
_MARKER = "requires_device"
_OPTION_DEST = "devicectx_devices"
_ACCELERATOR_DEST = "devicectx_accelerator"
_EMULATED_DEVICES_DEST = "devicectx_emulated_devices"
_ANY_ACCELERATOR = "accelerator"
_EMULATED = "emulated"


@dataclass(frozen=True)
class _Choice:
    """One device the ``device`` fixture runs on, or a listed one this machine lacks."""

    id: str
    device: torch.device | None
    skip_reason: str | None = None


@dataclass(frozen=True)
class _Emulated:
    """What ``--devicectx-accelerator=emulated`` gave: the time it took, or why it failed."""

    seconds: float
    failure: str | None = None


_CHOICES = pytest.StashKey[list[_Choice]]()
_EMULATED_STATE = pytest.StashKey[_Emulated]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("devicectx", "devicectx: testing on every device")
    group.addoption(
        "--devices",
        dest=_OPTION_DEST,
        default=None,
        metavar="DEVICES",
        help=(
            "comma-separated devices that tests taking the `device` fixture run on, e.g. "
            "--devices=cpu,meta or --devices=cpu,cuda:1 (default: every available device: "
            "the CPU and each accelerator index; meta only when listed). A listed device "
            "this machine lacks gives skipped tests."
        ),
    )
    group.addoption(
        "--devicectx-accelerator",
        dest=_ACCELERATOR_DEST,
        default=None,
        metavar="emulated[:PROFILE]",
        help=(
            "emulated: enable devicectx's emulated accelerator 'emu' (devices emu:0 and "
            "emu:1; built with a C++ compiler at first use, then cached) before collection, "
            "so that the `device` fixture and requires_device('accelerator') tests run on "
            "it; emulated:mps plays a device without float64 and record_stream (the profiles "
            "of devicectx.testing.emulated.PROFILES). If it cannot be built, the tests that "
            "need it are skipped with the reason."
        ),
    )
    group.addoption(
        "--devicectx-emulated-devices",
        dest=_EMULATED_DEVICES_DEST,
        default=None,
        type=int,
        metavar="N",
        help=(
            "how many devices --devicectx-accelerator=emulated gives (1 to 16, default 2); "
            "only with that option"
        ),
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{_MARKER}(device): skip the test, with the reason, unless this machine has the "
        "device: a kind ('cuda', 'mps', 'xpu'), one device ('cuda:1'), or 'accelerator' "
        "for any accelerator torch.accelerator reports (devicectx)",
    )
    accelerator = config.getoption(_ACCELERATOR_DEST, default=None)
    count = config.getoption(_EMULATED_DEVICES_DEST, default=None)
    if count is not None and accelerator is None:
        # Silently ignored, it would leave the run on the machine's own devices.
        msg = (
            f"--devicectx-emulated-devices={count}: sets the emulated accelerator's device "
            f"count, and --devicectx-accelerator=emulated is not given\n"
            f"fix: pytest --devicectx-accelerator=emulated --devicectx-emulated-devices={count}"
        )
        raise pytest.UsageError(msg)
    if accelerator is not None:
        # Before --devices is parsed (it may name emu:1) and before collection (the
        # fixture's parameters). With xdist, the controller builds first, under a file
        # lock; the workers then load the cached build.
        kind, colon, profile = accelerator.partition(":")
        if kind != _EMULATED or (colon and not profile):
            msg = (
                f"--devicectx-accelerator={accelerator}: the choices are emulated (which "
                f"plays a CUDA GPU) and emulated:PROFILE (emulated:mps plays MPS)\n"
                f"fix: --devicectx-accelerator={_emulated_for(kind)}"
            )
            raise pytest.UsageError(msg)
        _check_emulated_options(profile or None, count)
        enabled_count = _enabled_before(accelerator, profile or None, count)
        devices = enabled_count if count is None and enabled_count else _emulated_count(config)
        config.stash[_EMULATED_STATE] = _enable_emulated(devices, profile or None)
    text = config.getoption(_OPTION_DEST, default=None)
    if text is not None:
        # Parsed here, not at first use, so a bad spec stops the run before any test.
        config.stash[_CHOICES] = _parse_devices_option(text, _emulated_failure(config))


@pytest.hookimpl(trylast=True)
def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    # trylast: runs after pytest's own parametrize markers and any other hook, so a test
    # that parametrizes `device` itself is seen as such and left alone.
    if _FIXTURE not in metafunc.fixturenames or not _fixture_is_ours(metafunc):
        return
    markers = list(metafunc.definition.iter_markers(name=_MARKER))
    choices = _meeting(_choices(metafunc.config), markers, _emulated_failure(metafunc.config))
    params = [
        pytest.param(
            choice.device,
            id=choice.id,
            marks=() if choice.skip_reason is None else pytest.mark.skip(reason=choice.skip_reason),
        )
        for choice in choices
    ]
    metafunc.parametrize(_FIXTURE, params, indirect=True)


# Session scope: a device holds no state to reset between tests, module-scoped fixtures
# (a model built per device) can depend on it, and hypothesis's function_scoped_fixture
# health check does not fire in @given tests that take it. pytest groups the tests of
# each device together, as it does for any session-scoped parameter.
@pytest.fixture(scope="session")
def device(request: pytest.FixtureRequest) -> torch.device:
    """Each device to test on: the test runs once per device, with ids ``cpu``, ``cuda:0``, ...

    Without ``--devices``, every available device (``devicectx.available_devices()``: the
    CPU and each accelerator index); ``--devices=cpu,meta`` chooses, and a listed device that
    this machine lacks gives a skipped test with the reason.
    """
    chosen: torch.device | None = getattr(request, "param", None)
    if chosen is None:
        msg = (
            f"the {_FIXTURE!r} fixture was requested by name at run time "
            "(request.getfixturevalue), so it could not be parametrized over the devices\n"
            f"fix: take `{_FIXTURE}` as an argument of the test, or of a fixture it uses"
        )
        pytest.fail(msg, pytrace=False)
    return chosen


def pytest_report_header(config: pytest.Config) -> list[str]:
    # With an option given, the devices are known here at no cost (torch is imported
    # already); without one, pytest_report_collectionfinish says them, once collection
    # shows that some test takes the fixture.
    state = config.stash.get(_EMULATED_STATE, None)
    text: str | None = config.getoption(_OPTION_DEST, default=None)
    if state is None:
        return [] if text is None else _devices_lines(_choices(config), text)
    if state.failure is None:
        import torch

        first, *rest = _devices_lines(_choices(config), text)
        return [
            f"devicectx: emulated accelerator 'emu' enabled, {torch.accelerator.device_count()} "
            f"devices (built or loaded in {state.seconds:.1f} s); "
            f"{first.removeprefix('devicectx: ')}",
            *rest,
        ]
    return [
        "devicectx: the emulated accelerator is unavailable; tests that need it are skipped:",
        *(f"    {line}" for line in state.failure.splitlines()),
    ]


def pytest_report_collectionfinish(config: pytest.Config) -> list[str]:
    # Not called on an xdist controller, which collects nothing; there the check itself
    # (assert_device_agnostic) warns when its devices are one.
    told = config.stash.get(_EMULATED_STATE, None) is not None
    told = told or config.getoption(_OPTION_DEST, default=None) is not None
    if told or _CHOICES not in config.stash:
        return []
    return _devices_lines(config.stash[_CHOICES], None)


def _devices_lines(choices: list[_Choice], text: str | None) -> list[str]:
    """The report's lines on the devices the ``device`` fixture gives; ``text`` is
    ``--devices``'s value, None without the option. Where that is the CPU alone, a check
    with ``devices=["cpu", device]`` compares the CPU with itself and passes: they say so,
    with a fix."""
    running = [choice.id for choice in choices if choice.skip_reason is None]
    skipped = ", ".join(choice.id for choice in choices if choice.skip_reason is not None)
    skipped_note = [f"skipped here: {skipped}"] if skipped else []
    if running != ["cpu"]:
        listed = ", ".join(running) or "none"
        return [f"devicectx: the `{_FIXTURE}` fixture gives {listed}{_bracketed(skipped_note)}"]
    option = [] if text is None else [f"--devices={text}"]
    fix = (
        f"pytest --devicectx-accelerator={_EMULATED}, or pytest --devices=cpu,meta"
        if text is None
        else f"pytest --devices={text},meta"
    )
    return [
        f"devicectx: the `{_FIXTURE}` fixture gives cpu only"
        f"{_bracketed([*option, *skipped_note] or ['no accelerator here'])}: checks with "
        f"devices=['cpu', {_FIXTURE}] compare the CPU with itself",
        f"    fix: {fix}",
    ]


def _bracketed(notes: list[str]) -> str:
    """``notes`` as ``" (a; b)"``, or nothing where there are none."""
    return f" ({'; '.join(notes)})" if notes else ""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # A skip mark added here is reported at the test's own location, as skipif's is.
    emulated_failure = _emulated_failure(config)
    for item in items:
        for marker in item.iter_markers(name=_MARKER):
            reason = _missing_device(marker, emulated_failure)
            if reason is not None:
                item.add_marker(pytest.mark.skip(reason=reason))


def pytest_runtest_setup(item: pytest.Item) -> None:
    # A malformed marker fails its own test here, not the whole run at collection.
    for marker in item.iter_markers(name=_MARKER):
        problem = _marker_problem(marker)
        if problem is not None:
            pytest.fail(problem, pytrace=False)


def _choices(config: pytest.Config) -> list[_Choice]:
    choices = config.stash.get(_CHOICES, None)
    if choices is None:
        from devicectx.devices._resolve import available_devices

        choices = [_Choice(str(device), device) for device in available_devices()]
        failure = _emulated_failure(config)
        if failure is not None:
            reason = f"the emulated accelerator is unavailable: {_first_line(failure)}"
            # The ids the devices would have, skipped.
            count = _emulated_count(config)
            choices += [_Choice(f"emu:{index}", None, reason) for index in range(count)]
        config.stash[_CHOICES] = choices
    return choices


def _emulated_for(kind: str) -> str:
    """The emulated accelerator's option value that plays the device ``kind`` names: its
    profile where one is named for it (not the default), else the default, which plays
    CUDA."""
    from devicectx.testing import emulated

    named = kind.strip().lower()
    return f"{_EMULATED}:{named}" if named in emulated.PROFILES and named != "cuda" else _EMULATED


def _emulated_count(config: pytest.Config) -> int:
    count: int | None = config.getoption(_EMULATED_DEVICES_DEST, default=None)
    return 2 if count is None else count


def _check_emulated_options(profile: str | None, count: int | None) -> None:
    """Refuse a profile or device count that enable() would refuse, in the command line's
    words, before the build (a minute at first use)."""
    from devicectx.testing import emulated

    if profile is not None and profile not in emulated.PROFILES:
        names = ", ".join(map(repr, emulated.PROFILES))
        msg = (
            f"--devicectx-accelerator: emulated profile {profile!r} does not exist: the "
            f"profiles are {names}\nfix: --devicectx-accelerator=emulated:mps"
        )
        raise pytest.UsageError(msg)
    if count is not None and not 1 <= count <= 16:
        msg = (
            f"--devicectx-emulated-devices={count}: between 1 and 16 emulated devices\n"
            f"fix: --devicectx-emulated-devices=4"
        )
        raise pytest.UsageError(msg)


def _enabled_before(accelerator: str, profile: str | None, count: int | None) -> int | None:
    """The device count of an emulated accelerator a conftest (or a plugin) enabled before
    the option, None where none is; refuses, in the command line's words, an option that
    would silently change or keep what it set: another count, or CUDA asked for (plain
    ``emulated``) while it plays another device."""
    from devicectx.testing import emulated

    if not emulated.enabled():
        return None
    enabled: int = emulated._require().device_count()
    if count is not None and count != enabled:
        msg = (
            f"--devicectx-emulated-devices={count}: the emulated accelerator is already "
            f"enabled with {enabled} devices (enable() in a conftest or a plugin), a count "
            f"fixed for the process\nfix: --devicectx-emulated-devices={enabled}, or leave "
            f"the option out"
        )
        raise pytest.UsageError(msg)
    playing = _profile_played()
    if profile is None and playing != "cuda":
        keep = f"{_EMULATED}:{playing}" if playing is not None else "emulated:cuda"
        msg = (
            f"--devicectx-accelerator={accelerator}: plays a CUDA GPU, and the emulated "
            f"accelerator is already enabled playing {playing or 'another device'} "
            f"(enable(profile=...) or configure() in a conftest or a plugin)\n"
            f"fix: --devicectx-accelerator={keep} to keep it, or emulated:cuda to play CUDA"
        )
        raise pytest.UsageError(msg)
    return enabled


def _profile_played() -> str | None:
    """The profile whose device the emulated accelerator plays now, by the switches that
    tell the profiles apart (a memory limit set beside one does not); None for none."""
    from devicectx.testing import emulated

    now = emulated.settings()
    names = list(emulated.PROFILES)
    telling = {
        switch
        for switch in emulated.PROFILES[names[0]]
        if len({emulated.PROFILES[name][switch] for name in names}) > 1
    }
    for name in names:
        if all(now[switch] == emulated.PROFILES[name][switch] for switch in telling):
            return name
    return None


def _enable_emulated(devices: int, profile: str | None) -> _Emulated:
    from devicectx.testing import emulated

    started = time.perf_counter()
    try:
        emulated.enable(devices, profile=profile)
    except ValueError as error:  # what _check_emulated_options does not know of
        raise pytest.UsageError(f"--devicectx-accelerator: {error}") from None
    except emulated.EmulatedUnavailable as error:
        return _Emulated(time.perf_counter() - started, str(error))
    return _Emulated(time.perf_counter() - started)


def _emulated_failure(config: pytest.Config) -> str | None:
    """Why --devicectx-accelerator=emulated failed; None when it worked or was not asked."""
    state = config.stash.get(_EMULATED_STATE, None)
    return None if state is None else state.failure


def _parse_devices_option(text: str, emulated_failure: str | None) -> list[_Choice]:
    items = [item.strip() for item in text.split(",")]
    if not all(items):
        msg = (
            f"--devices={text!r}: an empty device name\n"
            "fix: list devices separated by commas, e.g. --devices=cpu,meta"
        )
        raise pytest.UsageError(msg)
    choices: list[_Choice] = []
    for item in items:
        choice = _listed_choice(item, text, emulated_failure)
        if all(choice.id != seen.id for seen in choices):
            choices.append(choice)
    return choices


def _listed_choice(item: str, text: str, emulated_failure: str | None) -> _Choice:
    """The device one item of ``--devices=text`` names, or why it is skipped; raises
    ``pytest.UsageError`` for an item that names no device."""
    from devicectx._errors import DeviceUnavailableError, InvalidDeviceError, without_fix
    from devicectx.devices._resolve import resolve_device

    if _names_emulated_off(item):
        # torch knows the device type only once the emulated accelerator is registered.
        if emulated_failure is None:
            msg = (
                f"--devices={text}: {item!r} is a device of devicectx's emulated accelerator, "
                f"which is not enabled in this run\n"
                f"fix: pytest --devicectx-accelerator={_EMULATED} --devices={text}"
            )
            raise pytest.UsageError(msg)
        why = f"the emulated accelerator is unavailable: {_first_line(emulated_failure)}"
        return _Choice(item, None, f"{why} (--devices={text})")
    try:
        device = resolve_device(item)
    except InvalidDeviceError as error:
        msg = (
            f"--devices={text}: {without_fix(error)}\n"
            "fix: --devices=cpu,meta (devices separated by commas)"
        )
        raise pytest.UsageError(msg) from None
    except DeviceUnavailableError as error:
        return _Choice(item, None, f"{_first_line(error)} (--devices={text})")
    return _Choice(str(device), device)


def _missing_device(marker: pytest.Mark, emulated_failure: str | None) -> str | None:
    """Why the test must be skipped for want of the marker's device; None when it is here."""
    from devicectx._errors import DeviceUnavailableError
    from devicectx.devices._resolve import accelerator_type, resolve_device

    if _marker_problem(marker) is not None:
        return None
    spec = _marker_device(marker)
    if _names_emulated_off(spec):
        return _emulated_off_reason(spec, emulated_failure)
    if spec == _ANY_ACCELERATOR:
        if accelerator_type() is not None:
            return None
        if emulated_failure is not None:
            why = f"the emulated accelerator is unavailable: {_first_line(emulated_failure)}"
        else:
            why = "no accelerator here (torch.accelerator.is_available() is False)"
        return f"{_MARKER}({spec!r}): {why}"
    try:
        resolve_device(spec)
    except DeviceUnavailableError as error:
        return f"{_MARKER}({spec!r}): {_first_line(error)}"
    return None


def _marker_device(marker: pytest.Mark) -> Any:
    """The one device the marker names, by position or as ``device=``; None where it names
    none or more than one."""
    given = [*marker.args, *(v for k, v in marker.kwargs.items() if k == "device")]
    if len(given) != 1 or set(marker.kwargs) - {"device"}:
        return None
    return given[0]


def _marker_problem(marker: pytest.Mark) -> str | None:
    """What is wrong with how the marker is written; None when nothing is."""
    from devicectx._errors import DeviceUnavailableError, InvalidDeviceError, without_fix
    from devicectx.devices._resolve import resolve_device

    spec = _marker_device(marker)
    if spec is None:
        given = ", ".join(
            [*map(repr, marker.args), *(f"{k}={v!r}" for k, v in marker.kwargs.items())]
        )
        # The first device given is the one meant, most likely; none given: an example.
        first = next(iter([*marker.args, *marker.kwargs.values()]), "cuda")
        return (
            f"@pytest.mark.{_MARKER}({given}): give exactly one device\n"
            f"fix: @pytest.mark.{_MARKER}({first!r})"
        )
    if spec == _ANY_ACCELERATOR or _names_emulated_off(spec):
        return None
    try:
        resolve_device(spec)
    except InvalidDeviceError as error:
        facts = without_fix(error)
        return f"@pytest.mark.{_MARKER}({spec!r}): {facts}\nfix: @pytest.mark.{_MARKER}('cuda')"
    except DeviceUnavailableError:
        pass
    return None


def _meeting(
    choices: list[_Choice], markers: list[pytest.Mark], emulated_failure: str | None
) -> list[_Choice]:
    """The devices of ``choices`` that every ``requires_device`` marker accepts: a test that
    requires an accelerator runs on accelerators only, never as ``[cpu]``. Where none is
    left, one skipped choice that says why (the marker's own skip covers a machine
    without the device; this, devices chosen with ``--devices`` that leave it out, or an
    emulated device in a run without the emulated accelerator)."""
    wanted = [_marker_device(marker) for marker in markers if _marker_problem(marker) is None]
    if not wanted:
        return choices
    kept = [choice for choice in choices if all(_accepts(spec, choice.id) for spec in wanted)]
    if kept:
        return kept
    listed = ", ".join(choice.id for choice in choices) or "none"
    specs = ", ".join(f"{_MARKER}({spec!r})" for spec in wanted)
    reason = f"{specs}: none of the devices to test on is one (they are: {listed})"
    emulated_off = [spec for spec in wanted if _names_emulated_off(spec)]
    if emulated_off:  # its skip reason says how to turn it on, which --devices cannot
        reason = _emulated_off_reason(emulated_off[0], emulated_failure)
    return [_Choice("-".join(str(spec) for spec in wanted), None, reason)]


def _accepts(spec: object, device_id: str) -> bool:
    """Whether the device of this id is what a ``requires_device(spec)`` marker asks for."""
    import torch

    # Split as text, not by torch.device: an emulated device's id ("emu:0", skipped where
    # the build failed) and spec name a type torch does not know until it is enabled.
    kind, index = _type_and_index(device_id)
    if spec == _ANY_ACCELERATOR:
        return kind not in ("cpu", "meta")
    if isinstance(spec, torch.device):
        required: tuple[str, int | None] | None = (spec.type, spec.index)
    elif isinstance(spec, str):
        required = _type_and_index(spec)
    else:  # an int: an index on the current accelerator
        required = None
    if required is None:
        return kind not in ("cpu", "meta") and index == spec
    return kind == required[0] and required[1] in (None, index)


def _emulated_off_reason(spec: object, emulated_failure: str | None) -> str:
    """Why a test that requires an emulated device is skipped in this run."""
    if emulated_failure is not None:
        why = f"the emulated accelerator is unavailable: {_first_line(emulated_failure)}"
    else:
        why = (
            "the emulated accelerator is not enabled "
            f"(run pytest --devicectx-accelerator={_EMULATED})"
        )
    return f"{_MARKER}({spec!r}): {why}"


def _type_and_index(text: str) -> tuple[str, int | None]:
    """``"cuda:1"`` as ``("cuda", 1)``, ``"cpu"`` as ``("cpu", None)``."""
    kind, _, index = text.strip().partition(":")
    return kind, int(index) if index else None


def _names_emulated_off(spec: object) -> bool:
    """Whether ``spec`` names an emulated device (``"emu"``, ``"emu:1"``) in a process where
    the emulated accelerator is not registered, so torch does not know its type."""
    if not isinstance(spec, str):
        return False
    from devicectx.testing import emulated

    kind, _, index = spec.strip().partition(":")
    named = kind == emulated.DEVICE_TYPE and (index == "" or index.isdigit())
    return named and not emulated.enabled()


def _fixture_is_ours(metafunc: pytest.Metafunc) -> bool:
    """True when ``device`` means this plugin's fixture and no one parametrized it already.

    A conftest may define its own ``device`` fixture, and a test may parametrize ``device``
    itself; either wins over this plugin. pytest has no public way to ask, so this reads
    ``Metafunc._calls`` and ``Metafunc._arg2fixturedefs`` (checked on pytest 8.0 to 9.2),
    falling back to the parametrize markers where those are missing.
    """
    for marker in metafunc.definition.iter_markers(name="parametrize"):
        argnames = marker.args[0] if marker.args else marker.kwargs.get("argnames", ())
        names = argnames.split(",") if isinstance(argnames, str) else argnames
        if _FIXTURE in {str(name).strip() for name in names}:
            return False
    if any(_FIXTURE in call.params for call in getattr(metafunc, "_calls", ())):
        return False
    by_name = getattr(metafunc, "_arg2fixturedefs", None)
    if by_name is None:
        return True
    definitions = by_name.get(_FIXTURE)
    if not definitions:
        return False
    function = getattr(definitions[-1], "func", None)
    return getattr(function, "__module__", None) == __name__


def _first_line(error: object) -> str:
    return str(error).partition("\n")[0]
