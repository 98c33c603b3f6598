//! `ferry._ferry.interop`: Python and Rust workers in one group.
//!
//! - **Python calls Rust.** A Rust worker's functions are typed
//!   registrations (`Function<A, R>`) with declared [`Shape`]s. A Python
//!   caller names one (`rpc.rpc_sync("rust", "add", args=(1, 2))`), asks
//!   its worker for its description once
//!   ([`DESCRIBE`], cached per worker and
//!   name): the argument and result shapes, the signature a call carries.
//!   Keywords name the fields of a struct argument (`arguments`: a Rust
//!   function names its arguments with a struct argument type; a tuple's
//!   items have no names). The arguments are converted to a [`Dyn`] by the
//!   argument shape
//!   (`convert`: a wrong value is a `TypeError` naming the function, its
//!   signature and where the value went wrong), encoded in the Rust type's
//!   own layout ([`value::Shaped`]) and sent as an ordinary typed call
//!   ([`Agent::call_dynamic`]): the callee's body gets its `A`, checked by
//!   the signature's hash as any typed call is. The reply is decoded by
//!   the result shape ([`value::Seed`]) and converted to Python. Tensors
//!   travel out of band both ways (`ferry_tch::Tensor`s), arriving as
//!   `torch.Tensor`s on the memory they landed in.
//! - **RRefs to Rust values.** `rpc.remote("rust", "make", ...)` runs the
//!   function by the RRef protocol ([`DynRRef::remote`]); the RRef
//!   ([`RustRRef`]) keeps the result shape, so `to_here()` fetches the
//!   value as the owner's type and converts it. It travels as an RRef to
//!   that type, in the arguments of Rust functions and, with its shape
//!   (`crate::wire::RustRRefWire`), in pickled Python calls and results:
//!   forked by the RRef protocol either way. Its proxies
//!   (`rref.rpc_sync().f(x)`) call the owner's function `f` with the RRef
//!   first, the closest a Rust value has to a method.
//! - **Rust calls Python.** `ferry.rpc.register(name, fn, args=...,
//!   returns=...)` declares a Python function for Rust callers, its shapes
//!   in the text Ferry writes shapes in (`parse`), at any time. Each
//!   becomes a registration ([`Functions::add_dynamic`]) in a
//!   [`LateFunctions`] every worker of the process serves, whose signature
//!   hashes as the declared Rust types do, so a Rust caller's
//!   `Function<A, R>` of those types reaches it (others are refused as
//!   wrong types); its arguments are decoded by the declared shape and
//!   converted to Python, its result converted back by the result shape.
//!   A Python exception reaches the caller as an `RpcError::Remote` whose
//!   text starts with the exception's type and message.
//!
//! [`Shape`]: ferry::rpc::schema::Shape
//! [`Dyn`]: value::Dyn
//! [`Agent::call_dynamic`]: ferry::rpc::Agent::call_dynamic
//! [`Functions::add_dynamic`]: ferry::rpc::Functions::add_dynamic

pub mod bind;
pub mod convert;
pub mod parse;
pub mod value;

use std::collections::HashMap;
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use ferry::rpc::describe::{Description, OwnedShape, ShapeNode, DESCRIBE};
use ferry::rpc::{CallOptions, Functions, LateFunctions, RpcError, Signature, Value, WorkerRef};
use ferry::rref::DynRRef;
use parking_lot::Mutex;
use pyo3::exceptions::{PyRuntimeError, PyTypeError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use crate::error::Error;
use crate::rpc::call::{timeout_of, worker_ref};
use crate::rpc::complete;
pub use crate::wire::RustRRef;
use convert::{short_repr, to_python, ToDyn};
use value::{Dyn, OwnedDyn, Seed, Shaped};

/// A Rust function as a Python caller knows it: its description, its
/// shapes checked.
struct Described {
    description: Description,
    args: Arc<OwnedShape>,
    result: Arc<OwnedShape>,
    worker: String,
}

impl Described {
    /// `name on worker "w" (fn(args) -> result)`, for errors.
    fn title(&self) -> String {
        format!(
            "{} on worker {:?} ({})",
            self.description.function,
            self.worker,
            self.description.signature_text()
        )
    }
}

/// Descriptions by (worker, function).
type Descriptions = HashMap<(String, String), Arc<Described>>;

/// Descriptions fetched in this worker's group.
static DESCRIBED: Mutex<Option<Descriptions>> = Mutex::new(None);

/// Forgets the descriptions of an earlier group (`init_rpc` calls it).
pub fn forget_descriptions() {
    DESCRIBED.lock().take();
}

/// Forgets the cached description of a call's function when its callee
/// refused the call as of a wrong type or an unknown function (the
/// function was registered again with other types, or removed), so that
/// the next call asks for it again; passes the error on.
fn forget_refused(d: &Described, e: RpcError) -> RpcError {
    if matches!(
        e,
        RpcError::WrongType { .. } | RpcError::UnknownFunction { .. }
    ) {
        if let Some(m) = DESCRIBED.lock().as_mut() {
            m.remove(&(d.worker.clone(), d.description.function.clone()));
        }
    }
    e
}

/// The description of `function` on `to`: cached, or asked for with the
/// GIL released.
fn described(
    py: Python<'_>,
    to: &WorkerRef,
    function: &str,
    timeout: Option<Duration>,
) -> Result<Arc<Described>, Error> {
    let worker = ferry::get_worker_info(Some(to.clone()))?.name;
    let key = (worker.clone(), function.to_string());
    if let Some(d) = DESCRIBED.lock().as_ref().and_then(|m| m.get(&key)) {
        return Ok(d.clone());
    }
    let name = function.to_string();
    let to2 = WorkerRef::Name(worker.clone());
    let reply = py.detach(|| match timeout {
        Some(t) => DESCRIBE.timeout(t).rpc_sync(to2, name),
        None => DESCRIBE.rpc_sync(to2, name),
    })?;
    let Some(description) = reply else {
        return Err(Error::Rpc(RpcError::UnknownFunction {
            worker,
            function: function.to_string(),
        }));
    };
    let bad = |e: ferry::rpc::describe::ShapeError| {
        Error::Argument(format!(
            "worker {worker:?} described {function:?} with a shape that cannot be used: {e}"
        ))
    };
    description.args.check().map_err(bad)?;
    description.result.check().map_err(bad)?;
    let d = Arc::new(Described {
        args: Arc::new(description.args.clone()),
        result: Arc::new(description.result.clone()),
        description,
        worker: worker.clone(),
    });
    DESCRIBED
        .lock()
        .get_or_insert_with(HashMap::new)
        .insert(key, d.clone());
    Ok(d)
}

/// Python's arguments as the value of the argument shape (see
/// [`bind_fields`] for a struct's):
///
/// - a tuple takes the positional arguments as its items (its items have
///   no names, so no keywords);
/// - `()` takes none;
/// - a struct takes its fields as a Python function `def f(a, b)` takes
///   its parameters, by position in declaration order or by name; one
///   positional argument alone that is the whole struct (a `dict` keyed
///   by field names, or an object with every field as an attribute) is
///   taken as it;
/// - any other shape takes exactly one positional argument.
///
/// With `method`, the first argument must be an RRef (an RRef proxy's
/// call: the RRef is the receiver).
fn arguments(
    d: &Described,
    args: &Bound<'_, PyTuple>,
    kwargs: Option<&Bound<'_, PyDict>>,
    method: bool,
) -> Result<Dyn, Error> {
    let type_error =
        |why: String| Error::Python(PyTypeError::new_err(format!("{} {why}", d.title())));
    let kwargs = kwargs.filter(|k| !k.is_empty());
    let root = d.args.node(0);
    if method {
        let first = match root {
            ShapeNode::Tuple(items) => items.first().copied(),
            ShapeNode::Struct { fields, .. } => fields.first().map(|(_, t)| *t),
            ShapeNode::Unit => None,
            _ => Some(0),
        };
        let is_rref = first.is_some_and(
            |n| matches!(d.args.node(n), ShapeNode::Opaque { name, .. } if name == "RRef"),
        );
        if !is_rref {
            return Err(type_error(
                "is not a method of an RRef: its first argument is not an RRef (a proxy of an \
                 RRef to a Rust value calls the owner's function of that name with the RRef \
                 as its first argument)"
                    .into(),
            ));
        }
    }
    let no_keywords = |why: &str| match kwargs {
        Some(k) => {
            let names: Vec<String> = k.keys().iter().map(|k| short_repr(&k)).collect();
            Err(type_error(format!(
                "takes no keyword arguments (got {}): {why}",
                names.join(", ")
            )))
        }
        None => Ok(()),
    };
    let mut to_dyn = ToDyn::new(&d.args);
    let value = match root {
        ShapeNode::Tuple(items) => {
            no_keywords(
                "its argument type is a tuple, whose items have no names (a Rust function \
                 names its arguments with a struct argument type)",
            )?;
            if args.len() != items.len() {
                return Err(type_error(format!(
                    "takes {} arguments, {} given",
                    items.len(),
                    args.len()
                )));
            }
            to_dyn.convert(args.as_any(), 0)
        }
        ShapeNode::Unit => {
            no_keywords("it takes no arguments")?;
            if !args.is_empty() {
                return Err(type_error(format!(
                    "takes no arguments, {} given",
                    args.len()
                )));
            }
            Ok(Dyn::Unit)
        }
        ShapeNode::Struct { fields, .. } => {
            let whole = match (args.len(), kwargs) {
                (1, None) => {
                    let arg = args.get_item(0)?;
                    convert::is_whole_struct(&arg, fields).then_some(arg)
                }
                _ => None,
            };
            match whole {
                Some(arg) => to_dyn.convert(&arg, 0),
                None => {
                    let dict = bind_fields(&d.args, fields, args, kwargs).map_err(type_error)?;
                    to_dyn.convert(dict.as_any(), 0)
                }
            }
        }
        _ => {
            no_keywords("its argument is one value, with no name")?;
            if args.len() != 1 {
                return Err(type_error(format!(
                    "takes 1 argument, {} given",
                    args.len()
                )));
            }
            to_dyn.convert(&args.get_item(0)?, 0)
        }
    };
    value.map_err(|m| type_error(format!("got a wrong argument: {m}")))
}

/// The fields of a struct argument, as a `dict`, from the call's
/// positional and keyword arguments ([`bind::bind`]: as Python binds a
/// call of `def f(a, b)`, an `Option` field neither gives `None`); or
/// why the call does not fit.
fn bind_fields<'py>(
    shape: &OwnedShape,
    fields: &[(String, u32)],
    args: &Bound<'py, PyTuple>,
    kwargs: Option<&Bound<'py, PyDict>>,
) -> Result<Bound<'py, PyDict>, String> {
    let py = args.py();
    let params: Vec<bind::Param<'_>> = fields
        .iter()
        .map(|(name, node)| bind::Param {
            name,
            optional: matches!(shape.node(*node), ShapeNode::Option(_)),
        })
        .collect();
    let keywords: Vec<(Bound<'py, PyAny>, Bound<'py, PyAny>)> =
        kwargs.map(|k| k.iter().collect()).unwrap_or_default();
    let names: Vec<Option<String>> = keywords
        .iter()
        .map(|(k, _)| {
            k.cast::<pyo3::types::PyString>()
                .ok()
                .and_then(|k| k.to_str().ok().map(str::to_string))
        })
        .collect();
    if let Some(((key, _), _)) = keywords.iter().zip(&names).find(|(_, n)| n.is_none()) {
        return Err(format!(
            "got a keyword that is not a str: {}",
            short_repr(key)
        ));
    }
    let name_refs: Vec<Option<&str>> = names.iter().map(Option::as_deref).collect();
    let sources = bind::bind(&params, args.len(), &name_refs)?;
    let bound = PyDict::new(py);
    for ((name, _), source) in fields.iter().zip(sources) {
        let value = match source {
            bind::Source::Positional(i) => args.get_item(i).map_err(|e| e.to_string())?,
            bind::Source::Keyword(k) => keywords[k].1.clone(),
            bind::Source::Absent => py.None().into_bound(py),
        };
        bound.set_item(name, value).map_err(|e| e.to_string())?;
    }
    Ok(bound)
}

/// Decodes a reply's payload by `shape`'s node `node`.
fn decode(
    shape: &OwnedShape,
    node: u32,
    bytes: &[u8],
    tensors: Vec<ferry::wire::payload::IncomingTensor>,
) -> Result<Dyn, ferry::wire::WireError> {
    ferry::wire::payload::decode_seed(Seed::at_node(shape, node), bytes, tensors)
}

/// A Rust callee's error as Python raises it: its text as raised there
/// (unescaped: a Python string holds any text).
fn rust_error(e: RpcError) -> Error {
    match e {
        RpcError::Remote {
            worker,
            function,
            message,
            omitted_bytes,
        } => {
            let more = if omitted_bytes > 0 {
                format!("…({omitted_bytes} more bytes)")
            } else {
                String::new()
            };
            Error::Python(PyRuntimeError::new_err(format!(
                "On worker {worker:?}, {function} failed: {message}{more}"
            )))
        }
        other => Error::Rpc(other),
    }
}

/// Calls the Rust function `function` on worker `to` with `args` and
/// returns its result (GIL released while it runs); raises `TypeError` for
/// arguments that do not fit its argument type. `method`: an RRef proxy's
/// call, the RRef first ([`arguments`]).
#[pyfunction]
#[pyo3(signature = (to, function, args, kwargs, timeout, method=false))]
fn rpc_sync<'py>(
    py: Python<'py>,
    to: &Bound<'py, PyAny>,
    function: &str,
    args: &Bound<'py, PyTuple>,
    kwargs: Option<&Bound<'py, PyDict>>,
    timeout: f64,
    method: bool,
) -> Result<Bound<'py, PyAny>, Error> {
    let to = worker_ref(to)?;
    let timeout = timeout_of(timeout)?;
    let d = described(py, &to, function, timeout)?;
    let value = arguments(&d, args, kwargs, method)?;
    let agent = ferry::rpc::agent()?;
    let result = py.detach(|| {
        let reply = agent
            .call_dynamic(
                to,
                function,
                d.description.signature,
                &Shaped::root(&d.args, &value),
                timeout,
            )
            .wait()
            .map_err(|e| rust_error(forget_refused(&d, e)))?;
        drop(value);
        agent
            .enter(|| decode(&d.result, 0, &reply.payload, reply.tensors))
            .map_err(|e| Error::Argument(format!("cannot read the result of {}: {e}", d.title())))
    })?;
    to_python(py, &d.result, 0, result)
}

/// Starts the Rust function `function` on worker `to`; `on_done(value,
/// error)` gets the result or the exception, on a thread of ferry-py's
/// own with the GIL held. Conversion errors raise at once.
#[pyfunction]
#[pyo3(signature = (to, function, args, kwargs, timeout, on_done, method=false))]
#[allow(clippy::too_many_arguments)]
fn rpc_async<'py>(
    py: Python<'py>,
    to: &Bound<'py, PyAny>,
    function: &str,
    args: &Bound<'py, PyTuple>,
    kwargs: Option<&Bound<'py, PyDict>>,
    timeout: f64,
    on_done: Py<PyAny>,
    method: bool,
) -> Result<(), Error> {
    let to = worker_ref(to)?;
    let timeout = timeout_of(timeout)?;
    let d = described(py, &to, function, timeout)?;
    let value = arguments(&d, args, kwargs, method)?;
    let agent = ferry::rpc::agent()?;
    let future = py.detach(|| {
        agent.call_dynamic(
            to,
            function,
            d.description.signature,
            &Shaped::root(&d.args, &value),
            timeout,
        )
    });
    drop(value);
    complete::spawn(future, move |py, outcome| {
        let on_done = on_done.bind(py);
        let value = outcome
            .map_err(|e| rust_error(forget_refused(&d, e)))
            .and_then(|reply| {
                let dynv = agent
                    .enter(|| decode(&d.result, 0, &reply.payload, reply.tensors))
                    .map_err(|e| {
                        Error::Argument(format!("cannot read the result of {}: {e}", d.title()))
                    })?;
                to_python(py, &d.result, 0, dynv)
            });
        match value {
            Ok(v) => on_done.call1((v, py.None())),
            Err(e) => on_done.call1((py.None(), PyErr::from(e).value(py))),
        }
        .map(drop)
    });
    Ok(())
}

/// Runs the Rust function `function` on worker `to`, its result kept
/// there, and returns at once the handle of an RRef to it.
#[pyfunction]
#[pyo3(signature = (to, function, args, kwargs, timeout, method=false))]
fn remote<'py>(
    py: Python<'py>,
    to: &Bound<'py, PyAny>,
    function: &str,
    args: &Bound<'py, PyTuple>,
    kwargs: Option<&Bound<'py, PyDict>>,
    timeout: f64,
    method: bool,
) -> Result<RustRRef, Error> {
    let to = worker_ref(to)?;
    let timeout = timeout_of(timeout)?;
    let d = described(py, &to, function, timeout)?;
    let value = arguments(&d, args, kwargs, method)?;
    let options = CallOptions {
        timeout,
        agent: None,
    };
    let rref = py
        .detach(|| DynRRef::remote(&options, to, &d.description, &Shaped::root(&d.args, &value)))?;
    Ok(RustRRef {
        rref,
        shape: d.result.clone(),
        node: 0,
    })
}

/// The signature of the function `function` on worker `to`, as text
/// (`fn((i64, i64)) -> i64`).
#[pyfunction]
#[pyo3(signature = (to, function, timeout))]
fn describe(
    py: Python<'_>,
    to: &Bound<'_, PyAny>,
    function: &str,
    timeout: f64,
) -> Result<String, Error> {
    let to = worker_ref(to)?;
    let d = described(py, &to, function, timeout_of(timeout)?)?;
    Ok(d.description.signature_text())
}

#[pymethods]
impl RustRRef {
    /// The owner's name.
    fn owner_name(&self, py: Python<'_>) -> String {
        py.detach(|| self.rref.owner_name())
    }

    /// The owner's rank.
    fn owner_id(&self) -> u32 {
        self.rref.owner()
    }

    /// Whether this worker owns the value.
    fn is_owner(&self) -> bool {
        self.rref.is_owner()
    }

    /// Whether the owner has confirmed this user (always true on the owner).
    fn confirmed_by_owner(&self, py: Python<'_>) -> bool {
        py.detach(|| self.rref.confirmed_by_owner())
    }

    /// The RRef's id, as text.
    fn rref_id(&self) -> String {
        self.rref.id().to_string()
    }

    /// The value's Rust type (`std::any::type_name` on its owner).
    fn type_name(&self) -> String {
        self.rref.type_name().to_string()
    }

    /// The value's shape, as text.
    fn shape(&self) -> String {
        self.shape.node_text(self.node)
    }

    /// A copy of the value, fetched from its owner by the RRef protocol and
    /// converted by its shape, with the timeout in seconds (negative: the
    /// agent's default; 0: none).
    #[pyo3(signature = (timeout))]
    fn to_here<'py>(&self, py: Python<'py>, timeout: f64) -> Result<Bound<'py, PyAny>, Error> {
        let timeout = timeout_of(timeout)?;
        let shape = self.shape.clone();
        let node = self.node;
        let value = py.detach(|| {
            self.rref.to_here_with(timeout, move |bytes, tensors| {
                decode(&shape, node, bytes, tensors)
            })
        })?;
        to_python(py, &self.shape, self.node, value)
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "RustRRefHandle({}, owner={}, type={})",
            self.rref.id(),
            self.owner_name(py),
            self.rref.type_name()
        )
    }
}

/// A Python function registered for Rust callers.
struct Registration {
    function: Py<PyAny>,
    args: Arc<OwnedShape>,
    result: Arc<OwnedShape>,
}

/// The Python functions registered for Rust callers (`register`), served
/// by this process's workers from the moment each is registered, before
/// `init_rpc` or after.
static REGISTERED: LazyLock<LateFunctions> = LazyLock::new(LateFunctions::new);

/// The prefix of the names of Ferry's own functions, which `register`
/// refuses.
const RESERVED: &str = "ferry.";

/// Registers `function` under `name` for Rust callers, its argument and
/// result types declared as shapes in text (`"(Tensor, f32)"`,
/// `"Point { x: i64, y: i64 }"`): a Rust `Function<A, R>` whose `A` and `R`
/// have those shapes calls it. At any time, before `init_rpc` or after:
/// a call or a description (`ferry.describe`) that arrives once it
/// returns finds it, one before finds no such function. Registering a
/// name again replaces its function. Raises `ValueError` for a shape that
/// does not parse or a name of Ferry's own (`ferry.` first).
#[pyfunction]
#[pyo3(signature = (name, function, args, returns))]
fn register(name: String, function: Py<PyAny>, args: &str, returns: &str) -> PyResult<()> {
    if name.starts_with(RESERVED) {
        return Err(pyo3::exceptions::PyValueError::new_err(format!(
            "{name:?}: names starting with {RESERVED:?} are Ferry's own functions'"
        )));
    }
    let shape = |text: &str, what: &str| {
        parse::parse(text).map_err(|e| {
            pyo3::exceptions::PyValueError::new_err(format!(
                "the {what} shape {text:?} of {name:?}: {e}"
            ))
        })
    };
    let args_shape = shape(args, "argument")?;
    let result_shape = shape(returns, "result")?;
    let leak = |s: &OwnedShape| parse::leak(s).map_err(pyo3::exceptions::PyValueError::new_err);
    let signature = Signature::from_shapes(
        Box::leak(args_shape.to_string().into_boxed_str()),
        Box::leak(result_shape.to_string().into_boxed_str()),
        leak(&args_shape)?,
        leak(&result_shape)?,
    );
    let registration = Arc::new(Registration {
        function,
        args: Arc::new(args_shape),
        result: Arc::new(result_shape),
    });
    let decoding = registration.clone();
    let running = registration;
    let name_run = name.clone();
    REGISTERED.update(|functions| {
        functions.add_dynamic(
            &name,
            signature,
            move |bytes, tensors| {
                decode(&decoding.args, 0, bytes, tensors).map_err(|e| e.to_string())
            },
            move |args: Dyn| run_registered(&name_run, &running, args),
        );
    });
    tracing::debug!(function = %name, "registered a Python function for Rust callers");
    Ok(())
}

/// Makes `functions` serve the Python functions registered for Rust
/// callers, those registered later included.
pub fn add_registered(functions: &mut Functions) {
    functions.serve_late(REGISTERED.clone());
}

/// Runs a registered Python function on arguments from a Rust caller.
fn run_registered(name: &str, r: &Registration, args: Dyn) -> Result<Value, String> {
    Python::attach(|py| {
        let raised = |e: PyErr| exception_text(py, &e);
        let args = to_python(py, &r.args, 0, args).map_err(|e| raised(e.into()))?;
        let call = match r.args.node(0) {
            ShapeNode::Tuple(_) => {
                let args = args
                    .cast_into::<PyTuple>()
                    .map_err(|e| raised(PyErr::from(e)))?;
                r.function.bind(py).call1(args)
            }
            ShapeNode::Unit => r.function.bind(py).call0(),
            _ => r.function.bind(py).call1((args,)),
        };
        let result = call.map_err(raised)?;
        let value = ToDyn::new(&r.result).convert(&result, 0).map_err(|m| {
            format!(
                "TypeError: {name} returned a value that is not its declared {}: {m}",
                r.result
            )
        })?;
        Ok(Value::new(OwnedDyn {
            shape: r.result.clone(),
            value,
        }))
    })
}

/// `Type: message` of a Python exception, then its traceback.
fn exception_text(py: Python<'_>, e: &PyErr) -> String {
    let ty = e
        .get_type(py)
        .qualname()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "Exception".into());
    let mut text = format!("{ty}: {}", e.value(py));
    if let Some(tb) = e.traceback(py).and_then(|tb| tb.format().ok()) {
        text.push('\n');
        text.push_str(&tb);
    }
    text
}

/// Counts of this worker's RRef tables (PyTorch's `_get_debug_info` RRef
/// part), as a `dict`.
#[pyfunction]
fn rref_debug_info(py: Python<'_>) -> Result<Bound<'_, PyDict>, Error> {
    let info = ferry::debug_info()?;
    let d = PyDict::new(py);
    d.set_item("num_owner_rrefs", info.num_owner_rrefs)?;
    d.set_item("num_confirmed_users", info.num_confirmed_users)?;
    d.set_item("num_pending_users", info.num_pending_users)?;
    d.set_item("num_pending_children", info.num_pending_children)?;
    d.set_item("num_pending_control", info.num_pending_control)?;
    d.set_item("num_pending_remotes", info.num_pending_remotes)?;
    Ok(d)
}

/// Waits (GIL released) until this worker's RRef tables are empty, at
/// most `timeout` seconds; returns `None`, or the counts left as a
/// `str` if they never emptied.
#[pyfunction]
fn rref_wait_until_empty(py: Python<'_>, timeout: f64) -> Result<Option<String>, Error> {
    let timeout = timeout_of(timeout)?.unwrap_or(Duration::ZERO);
    let ctx = ferry::rref::RRefContext::current()?;
    Ok(py
        .detach(|| ctx.wait_until_empty(timeout))
        .err()
        .map(|left| format!("{left:?}")))
}

/// Adds the submodule `interop` to `parent`.
pub fn register_module(parent: &Bound<'_, PyModule>) -> PyResult<()> {
    let m = PyModule::new(parent.py(), "interop")?;
    m.add_function(wrap_pyfunction!(rpc_sync, &m)?)?;
    m.add_function(wrap_pyfunction!(rpc_async, &m)?)?;
    m.add_function(wrap_pyfunction!(remote, &m)?)?;
    m.add_function(wrap_pyfunction!(describe, &m)?)?;
    m.add_function(wrap_pyfunction!(register, &m)?)?;
    m.add_function(wrap_pyfunction!(rref_debug_info, &m)?)?;
    m.add_function(wrap_pyfunction!(rref_wait_until_empty, &m)?)?;
    m.add_class::<RustRRef>()?;
    parent.add_submodule(&m)
}
