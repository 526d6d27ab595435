"""The one place devicectx touches the private side of ``torch.compile`` (dynamo).

Why: a wrapt ``FunctionWrapper`` passes for the function it wraps, so dynamo would inline
the wrapped code and drop the wrapper (:mod:`devicectx.decorator._wrappers`). dynamo has no public
way to say "trace this function in place of this object"; it honours the attributes its own
wrappers (``torch.compile``'s, ``torch.jit``'s) carry, and those are what is used here.

Checked on torch 2.6.0, 2.10.0, 2.11.0, 2.12.1, 2.13.0 and 2.15.0; :mod:`devicectx.decorator._probe`
checks the installed torch at first use, and tests/test_decorator_compile.py on each
release CI covers:

- ``_torchdynamo_inline``: the function dynamo inlines in place of an object it is about to
  call (``variables/builder.py``, ``variables/functions.py``, ``variables/user_defined.py``,
  ``variables/nn_module.py`` from 2.15). Up to 2.11 it is read with
  ``inspect.getattr_static``, which sees the class's attribute (not the instance's: a wrapt
  proxy's ``__dict__`` is the wrapped function's), so it must be a function there; from 2.12
  also by plain ``getattr``, which must not bind it: :func:`install` puts it in both places.
- ``_torchdynamo_orig_callable`` with ``_torchdynamo_wrapper_id``: what
  ``torch.compile(obj)`` compiles instead of ``obj`` (``eval_frame.innermost_fn``), when
  the id is ``id(obj)``.
- ``OptimizedModule`` (``torch._dynamo.eval_frame``) and its ``_orig_mod``: what
  ``torch.compile(module)`` returns, and the module it compiled (:func:`compiled_original`).
- ``__script_unsupported``: what ``torch.jit.script`` refuses a function with (as
  ``"TorchScript error: " + message``), for the function itself and for one a scripted
  function calls (:func:`refuse_script`); checked on 2.13.
- ``torch._dynamo.graph_break(msg=...)`` (from 2.7): a graph break whose ``fullgraph=True``
  error quotes the message.
- ``_dynamo_marked_constant``: all that ``torch.compiler.assume_constant_result`` sets, and
  all dynamo reads (it calls the function once while tracing and keeps the result).
- ``torch._guards.TracingContext.try_get()``: whether dynamo is tracing, for code it runs
  rather than traces (up to 2.12, ``torch.compiler.is_compiling()`` is true only in traced
  code; from 2.13 for the whole compile). Read as the ``tracing_context`` of the
  ``torch._guards._TLS`` thread-local, which is what it returns.
- ``trace_rules.get_torch_obj_rule_map()``, ``variables.torch.get_overridable_functions()``
  and ``torch.overrides._get_overridable_functions()``: tables of torch's functions, built
  once (at dynamo's first trace) by looking their names up in torch's modules; built while
  :mod:`devicectx.scope._constructors` has replaced the constructors, they would list the
  replacements and no longer know torch's own functions (then a `with torch.device` in
  traced code no longer applies to them: torch 2.7 to 2.10); built before, they do not
  know the replacements (the same, for a replacement dynamo inlines). :func:`keep_trace_rules`
  lists both in them.
- ``InstructionTranslator.current_tx().symbolic_torch_function_state.mode_stack``: the mode
  stack dynamo traces with (it clears the thread's own while it compiles), each entry's
  ``value`` the mode; ``torch_function_mode_stack_state_mgr.stack``, the thread's stack it
  saved, where no frame is being traced.
- ``torch._C._get_dispatch_mode(_TorchDispatchModeKey.FAKE)``: whether fake tensors are
  being made, as dynamo does to learn what a call in its graph returns.
- the compile event log (``torch._dynamo.utils.get_chromium_event_logger()``): a compile
  started while another is being traced (the probe's) clears the log's per-thread stack of
  open events up to 2.12, and the outer compile then warns that its events are gone
  (2.13 restores the depth itself). :func:`nested_compile` puts the stack back.
- what :func:`nested_compile` clears for a compile made while another is traced (the
  probe's), to make it in an ordinary context: ``torch.compiler._is_exporting_flag`` (set
  by a strict ``torch.export``, where ``torch.compile`` compiles nothing), the functorch
  layers of ``torch._C._functorch`` (``peek_interpreter_stack``,
  ``pop_dynamic_layer_stack``, ``push_dynamic_layer_stack``: ``vmap``, ``grad``), the
  dynamo settings a strict export sets (the fields of ``torch.export._trace.ExportDynamoConfig``,
  each put back to the default kept in ``torch._dynamo.config._config``; checked on 2.13);
  and
  what it puts back: ``torch_function_mode_stack_state_mgr.stack``, the modes of a
  ``with torch.device(...)`` around the outer compile (checked on 2.13 only).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import sys
import types
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar, cast

import torch
from torch._guards import TracingContext

_F = TypeVar("_F", bound=Callable[..., Any])
_is_compiling = torch.compiler.is_compiling

INLINE = "_torchdynamo_inline"
ORIG_CALLABLE = "_torchdynamo_orig_callable"
WRAPPER_ID = "_torchdynamo_wrapper_id"
SCRIPT_UNSUPPORTED = "__script_unsupported"
CLASS_HOOKS = (INLINE, ORIG_CALLABLE, WRAPPER_ID)
"""What :func:`install` puts on a class."""


def install(cls: type, instance: object, entry: Callable[..., Any]) -> None:
    """Make dynamo trace ``entry`` wherever it meets ``instance``, the one object of ``cls``.

    The class gets the attributes (for ``inspect.getattr_static``), and so does the
    instance's own dict (for ``getattr``, which would otherwise bind the class's function to
    the instance). A wrapt proxy sets an attribute on itself, not on the wrapped function,
    where its class has one: so the class first.
    """
    for name in (INLINE, ORIG_CALLABLE):
        setattr(cls, name, entry)
        setattr(instance, name, entry)
    setattr(cls, WRAPPER_ID, id(instance))


# TracingContext.try_get() is getattr(_TLS, "tracing_context", None): on a thread where no
# compile ever set it, that raises and clears an AttributeError in every constructor
# called in a block (torch 2.15 gives the attribute a default). The thread's own dict of the
# thread-local answers the same without it.
_GUARDS_TLS: Any = getattr(torch._guards, "_TLS", None)


def tracing() -> bool:
    """Whether dynamo is tracing on this thread: for code it runs rather than traces."""
    if _is_compiling():
        return True
    if _GUARDS_TLS is None:  # pragma: no cover - a torch that keeps it elsewhere
        return TracingContext.try_get() is not None
    return _GUARDS_TLS.__dict__.get("tracing_context") is not None


def constant(fn: _F) -> _F:
    """``torch.compiler.assume_constant_result``, without importing dynamo at import time.

    That function imports ``torch._dynamo`` (a second on top of ``import torch``) only to
    set this one attribute.
    """
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


def never_top_level(code: types.CodeType) -> bool:
    """Tell dynamo never to compile a frame of ``code`` on its own (it still inlines it
    into the code it traces). Called where dynamo traces it, so dynamo is loaded.

    A constructor's replacement called between graphs of a compiled function would be
    compiled as a frame of its own, whose graph calls ``torch.as_tensor`` (say) by name:
    the replacement again, run by its compiled code, without end. Private API:
    ``skip_code``, in ``torch._dynamo.eval_frame`` (2.7 to 2.15) or its C module (2.6).
    """
    for module in ("torch._dynamo.eval_frame", "torch._C._dynamo.eval_frame"):
        skip = getattr(sys.modules.get(module), "skip_code", None)
        if skip is not None:
            skip(code)
            return True
    return False


def loaded() -> bool:
    """Whether dynamo is imported (its frame evaluation, at least)."""
    return "torch._dynamo.eval_frame" in sys.modules


def called_by_dynamo(depth: int) -> bool:
    """Whether the frame ``depth`` levels above the caller (1: the caller's caller) runs
    dynamo's own code (not code it traces). dynamo running a call of its graph on fake
    tensors, to learn what it returns, runs traced code: not its own.

    No frame is read where ``torch._dynamo`` is not in ``sys.modules`` (its import puts it
    there first, so none of its code can be running): a frame costs more to read than the
    rest of a constructor's way through a block.
    """
    if "torch._dynamo" not in sys.modules:
        return False
    caller = sys._getframe(depth + 1).f_globals.get("__name__", "")
    return isinstance(caller, str) and caller.startswith("torch._dynamo") and not faking()


def refuse_script(cls: type, message: Callable[[Any], str]) -> None:
    """Make ``torch.jit.script`` refuse the objects of ``cls``, with ``message(obj)``:
    TorchScript compiles a function's source, and a wrapper's is its wrapped function's."""
    setattr(cls, SCRIPT_UNSUPPORTED, property(message))


def compiled_original(module: object) -> Any:
    """The module ``torch.compile(module)`` compiled, where ``module`` is what it returned
    (an ``OptimizedModule``, which keeps it as ``_orig_mod``); else None."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    optimized = getattr(eval_frame, "OptimizedModule", None)
    if optimized is None or not isinstance(module, optimized):
        return None  # dynamo not loaded: nothing was compiled
    return getattr(module, "_orig_mod", None)


def disable(fn: _F) -> _F:
    """``torch.compiler.disable``: a call of ``fn`` in traced code is a graph break."""
    disabled: _F = torch.compiler.disable(fn)  # type: ignore[no-untyped-call]
    return disabled


def graph_break(message: str) -> bool:
    """In traced code, a graph break whose error quotes ``message``; False, and nothing
    done, where torch's ``graph_break`` takes no message (2.6)."""
    if not _graph_break_takes_message():
        return False
    torch._dynamo.graph_break(msg=message)
    return True


@constant
def _graph_break_takes_message() -> bool:
    import torch._dynamo

    return "msg" in inspect.signature(torch._dynamo.graph_break).parameters


def traced_mode_stack() -> list[object]:
    """The function modes, bottom first, that the code dynamo is tracing runs under."""
    convert = sys.modules.get("torch._dynamo.symbolic_convert")
    translator = getattr(convert, "InstructionTranslator", None)
    try:
        state = translator.current_tx().symbolic_torch_function_state  # type: ignore[union-attr]
        return [variable.value for variable in state.mode_stack]
    except (AttributeError, IndexError, RuntimeError):
        modes = sys.modules.get("torch._dynamo.variables.torch_function")
        manager = getattr(modes, "torch_function_mode_stack_state_mgr", None)
        return list(getattr(manager, "stack", []))


def traced_mode_device(mode: Any) -> torch.device | None:
    """The device of a ``DeviceContext`` on the stack of the code dynamo traces; None where
    it cannot be read.

    One entered in the traced code itself (a decorated call's body, in a compiled caller's
    graph) is an object dynamo made without running its ``__init__``: its ``device`` is
    among dynamo's pending attribute writes, not on the object. Checked on torch 2.6.0 to
    2.15.0.
    """
    device = getattr(mode, "device", None)
    if device is not None:
        return cast(torch.device, device)
    convert = sys.modules.get("torch._dynamo.symbolic_convert")
    translator = getattr(convert, "InstructionTranslator", None)
    try:
        tx = translator.current_tx()  # type: ignore[union-attr]
        for variable in tx.symbolic_torch_function_state.mode_stack:
            if variable.value is mode:
                writes = tx.output.side_effects.store_attr_mutations.get(variable, {})
                written = writes.get("device")
                return None if written is None else cast(torch.device, written.as_python_constant())
    except (AttributeError, IndexError, RuntimeError, NotImplementedError):
        pass
    return None


def faking() -> bool:
    """Whether code runs on fake tensors (dynamo working out what a graph call returns)."""
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None


def keep_trace_rules(replaced: Iterable[tuple[object, object]]) -> None:
    """Make dynamo's tables of torch functions list both of each ``(original, replacement)``
    pair, alike, building them now if dynamo is loaded and has not built them yet.

    A table built while the replacements were in place lists them (the tables look names
    up in torch's modules), one built before lists torch's own: either way, dynamo must
    know both, as the same function (the replacement put in the graph, or inlined to call
    the original; a traced `with torch.device` applying to either). Checked on torch 2.6
    to 2.15: the tables are ``trace_rules.get_torch_obj_rule_map()``, ``variables.torch``'s
    ``get_overridable_functions()`` and ``TorchInGraphFunctionVariable._get_handlers()``,
    and ``torch.overrides._get_overridable_functions()``.
    """
    pairs = list(replaced)
    rules = sys.modules.get("torch._dynamo.trace_rules")
    table = getattr(rules, "get_torch_obj_rule_map", None)
    if not callable(table):
        return  # dynamo is not loaded: it builds the tables later, from torch's modules
    built = table()
    for original, replacement in pairs:
        rule = built.get(replacement, built.get(original))
        if rule is not None:
            built.setdefault(original, rule)
            built.setdefault(replacement, rule)
    # The functions torch function modes (a traced `with torch.device`) apply to.
    variables = sys.modules.get("torch._dynamo.variables.torch")
    overridable = getattr(variables, "get_overridable_functions", None)
    functions = overridable() if callable(overridable) else None
    if isinstance(functions, set):
        for pair in pairs:
            if functions.intersection(pair):
                functions.update(pair)
    listed, names = torch.overrides._get_overridable_functions()
    for original, replacement in pairs:
        name = names.get(replacement, names.get(original))  # type: ignore[call-overload]
        if name is None:
            continue
        for function, other in ((original, replacement), (replacement, original)):
            if function not in names:
                names[function] = name  # type: ignore[index]
                for functions_of_namespace in listed.values():
                    if other in functions_of_namespace:
                        functions_of_namespace.append(function)  # type: ignore[arg-type]
    # The functions dynamo handles in a way of its own (torch.from_numpy, torch.full,
    # torch.tensor, ...), keyed by the function each name held when the table was built.
    in_graph = getattr(variables, "TorchInGraphFunctionVariable", None)
    handlers_of = getattr(in_graph, "_get_handlers", None)
    handlers = handlers_of() if callable(handlers_of) else None
    if isinstance(handlers, dict):
        for original, replacement in pairs:
            handler = handlers.get(replacement, handlers.get(original))
            if handler is not None:
                handlers.setdefault(original, handler)
                handlers.setdefault(replacement, handler)


@contextlib.contextmanager
def nested_compile() -> Iterator[None]:
    """Run a compile while dynamo traces another, as a compile of its own in an ordinary
    context: not exported, under no functorch transform, and leaving the outer one's
    event log and saved mode stack intact."""
    logger = _event_logger()
    saved = [list(part) if isinstance(part, list) else dict(part) for part in _log_parts(logger)]
    modes = _saved_modes()
    stack = None if modes is None else modes.stack
    try:
        with _not_exporting(), _export_settings_undone(), _no_functorch_transforms():
            yield
    finally:
        if modes is not None:
            modes.stack = stack
        for part, before in zip(_log_parts(logger), saved, strict=True):
            if part != before:
                part.clear()
                part.update(before) if isinstance(part, dict) else part.extend(before)


def _saved_modes() -> Any:
    """Where dynamo keeps the thread's torch function modes (a ``torch.device`` block)
    while it compiles: ``torch_function_mode_stack_state_mgr``, one for all compiles. A
    nested compile replaces its ``stack`` with the (empty) one of the outer compile and
    then empties it: the outer compile would then check its guards against no modes (a
    failed guard of its own) and give the thread no modes back."""
    modes = sys.modules.get("torch._dynamo.variables.torch_function")
    manager = getattr(modes, "torch_function_mode_stack_state_mgr", None)
    return manager if isinstance(getattr(manager, "stack", None), list) else None


@contextlib.contextmanager
def _not_exporting() -> Iterator[None]:
    """Inside ``torch.export``'s region (``torch.compiler._is_exporting_flag``, a global),
    ``torch.compile`` returns its function uncompiled: a compile made there is none. The
    flag is off only while the outer compile holds dynamo's compile lock (the probe runs
    while dynamo traces): no other thread's compile reads it meanwhile, though code that
    another thread's non-strict export runs at that moment would."""
    compiler = torch.compiler
    exporting = getattr(compiler, "_is_exporting_flag", None)
    if not exporting:
        yield
        return
    compiler._is_exporting_flag = False
    try:
        yield
    finally:
        compiler._is_exporting_flag = exporting


@contextlib.contextmanager
def _export_settings_undone() -> Iterator[None]:
    """dynamo's settings as ``torch.compile`` has them, where a strict ``torch.export`` set
    its own (``torch.export._trace.ExportDynamoConfig``): among them, a warning for each
    Python side effect of the code traced, which the probe's code has (it enters and leaves
    a device scope) and the exported model has not."""
    try:
        from torch.export._trace import ExportDynamoConfig
    except ImportError:
        yield
        return
    config = torch._dynamo.config
    entries = getattr(config, "_config", {})
    undone = {}
    for field in dataclasses.fields(ExportDynamoConfig):
        entry = entries.get(field.name)
        default = getattr(entry, "default", None)
        if entry is not None and getattr(config, field.name) != default:
            undone[field.name] = default
    with config.patch(**undone) if undone else contextlib.nullcontext():
        yield


@contextlib.contextmanager
def _no_functorch_transforms() -> Iterator[None]:
    """The thread's functorch transforms (``vmap``, ``grad``) set aside: code run inside
    ``vmap`` cannot draw random numbers (``nn.Linear``'s initialisation)."""
    functorch = torch._C._functorch
    layers = []
    try:
        while functorch.peek_interpreter_stack() is not None:
            layers.append(functorch.pop_dynamic_layer_stack())
        yield
    finally:
        while layers:
            functorch.push_dynamic_layer_stack(layers.pop())


def _event_logger() -> object:
    utils = sys.modules.get("torch._dynamo.utils")
    get = getattr(utils, "get_chromium_event_logger", None)
    return get() if callable(get) else None


def _log_parts(logger: object) -> list[Any]:
    """The per-thread stacks and open-event data of dynamo's event log, where it has them."""
    parts = []
    for name in ("get_stack", "get_pt2_compile_substack", "get_event_data"):
        get = getattr(logger, name, None)
        part = get() if callable(get) else None
        if isinstance(part, (list, dict)):
            parts.append(part)
    return parts
