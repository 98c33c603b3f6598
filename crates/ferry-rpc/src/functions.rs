//! Remote functions: ordinary Rust functions registered under a stable name
//! on every worker, with typed arguments and results through serde.

use std::any::type_name;
use std::borrow::Cow;
use std::collections::HashMap;
use std::marker::PhantomData;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use ferry_wire::payload::{self, IncomingTensor};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::boxed::BoxFuture;
use crate::protocol::{Failure, FailureKind};
use crate::reply::{Outcome, Reply};
use crate::schema::{Schema, Shape};
use crate::watch;
use crate::Value;

/// The type signature of a remote function: its argument and result types.
///
/// Calls carry their caller's signature as a [`SignatureId`]; the callee
/// refuses a call whose signature differs from its registration with a
/// wrong-type error naming both, instead of misreading the bytes.
///
/// A typed registration or call ([`Function`](crate::Function)) has
/// [`schema`](Self::schema): the declared shapes of its types, compared by
/// their hash alone, so builds made with different compilers agree. A
/// string-named one has only `std::any::type_name`s, compared by their
/// hash, as between builds of one compiler; a typed caller and a
/// string-named registration (or the reverse) meet on those.
///
/// ```
/// use ferry_rpc::Signature;
///
/// let dynamic = Signature::of::<(i64, i64), i64>();
/// let typed = Signature::typed::<(i64, i64), i64>();
/// assert_eq!(typed.to_string(), "fn((i64, i64)) -> i64");
/// assert!(typed.accepts(&typed.id()) && typed.accepts(&dynamic.id()));
/// assert!(dynamic.accepts(&typed.id()));
/// assert!(!typed.accepts(&Signature::typed::<(i64, u8), i64>().id()));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Signature {
    /// `std::any::type_name` of the argument type.
    pub args: &'static str,
    /// `std::any::type_name` of the result type.
    pub result: &'static str,
    /// The declared shapes, for typed registrations and calls.
    pub schema: Option<SignatureSchema>,
}

/// The declared shapes of a typed function's argument and result types.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SignatureSchema {
    /// The argument type's shape.
    pub args: &'static Shape,
    /// The result type's shape.
    pub result: &'static Shape,
    /// Their stable hash (computed by the compiler).
    pub hash: u64,
}

/// What a call carries for its callee's type check: the hashes of its
/// caller's [`Signature`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct SignatureId {
    /// [`Signature::hash`]: the hash of the type names.
    pub types: u64,
    /// The schema hash of a typed caller.
    pub schema: Option<u64>,
}

/// The schema hash of functions from `A` to `R`, as a constant.
struct SchemaHash<A: ?Sized, R: ?Sized>(PhantomData<fn(&A) -> &R>);

impl<A: Schema + ?Sized, R: Schema + ?Sized> SchemaHash<A, R> {
    const HASH: u64 = crate::schema::hash_signature(A::SHAPE, R::SHAPE);
}

impl Signature {
    /// The signature of string-named functions from `A` to `R` (type names only).
    pub fn of<A, R>() -> Self {
        Self {
            args: type_name::<A>(),
            result: type_name::<R>(),
            schema: None,
        }
    }

    /// The signature of typed functions from `A` to `R`: with their schema.
    pub fn typed<A: Schema, R: Schema>() -> Self {
        Self {
            schema: Some(SignatureSchema {
                args: A::SHAPE,
                result: R::SHAPE,
                hash: SchemaHash::<A, R>::HASH,
            }),
            ..Self::of::<A, R>()
        }
    }

    /// A stable 64-bit hash (FNV-1a) of the type names.
    pub fn hash(&self) -> u64 {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in self
            .args
            .bytes()
            .chain(std::iter::once(0))
            .chain(self.result.bytes())
        {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        h
    }

    /// What a call with this signature carries.
    pub fn id(&self) -> SignatureId {
        SignatureId {
            types: self.hash(),
            schema: self.schema.map(|s| s.hash),
        }
    }

    /// Whether a registration with this signature takes a call that
    /// carries `caller`: by schema when both are typed, by type names
    /// otherwise.
    pub fn accepts(&self, caller: &SignatureId) -> bool {
        match (self.schema, caller.schema) {
            (Some(mine), Some(theirs)) => mine.hash == theirs,
            _ => self.hash() == caller.types,
        }
    }
}

impl Signature {
    /// The signature written with its type names, module paths left out
    /// ([`short_type_name`]): `fn((RRef<i64>, String)) -> i64`.
    pub fn short_names(&self) -> String {
        format!(
            "fn({}) -> {}",
            short_type_name(self.args),
            short_type_name(self.result)
        )
    }

    /// The signature as an error shows it beside another it was compared
    /// with, so that both read the same way: as declared shapes when the
    /// two were compared by schema (`by_schema`: both typed) and this one
    /// has them, otherwise as [`short_names`](Self::short_names).
    ///
    /// ```
    /// use ferry_rpc::Signature;
    ///
    /// let typed = Signature::typed::<(Vec<String>, i64), i64>();
    /// assert_eq!(typed.shown(true), "fn(([String], i64)) -> i64");
    /// assert_eq!(typed.shown(false), "fn((Vec<String>, i64)) -> i64");
    /// ```
    pub fn shown(&self, by_schema: bool) -> String {
        match (&self.schema, by_schema) {
            (Some(s), true) => format!("fn({}) -> {}", s.args, s.result),
            _ => self.short_names(),
        }
    }
}

/// Typed signatures show their declared shapes, others their
/// [`short_names`](Signature::short_names).
impl std::fmt::Display for Signature {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.shown(true))
    }
}

/// A `std::any::type_name` without module paths: every path keeps only
/// its last segment.
///
/// ```
/// use ferry_rpc::short_type_name;
///
/// assert_eq!(
///     short_type_name("(ferry_rref::rref::RRef<i64>, alloc::string::String)"),
///     "(RRef<i64>, String)"
/// );
/// assert_eq!(
///     short_type_name("core::option::Option<alloc::vec::Vec<[u8; 4]>>"),
///     "Option<Vec<[u8; 4]>>"
/// );
/// assert_eq!(short_type_name("&dyn core::any::Any"), "&dyn Any");
/// ```
pub fn short_type_name(name: &str) -> String {
    let is_ident = |c: char| c.is_alphanumeric() || c == '_';
    let mut out = String::with_capacity(name.len());
    // Where the path being read started in `out`.
    let mut path = 0;
    let mut rest = name;
    while let Some(c) = rest.chars().next() {
        if rest.starts_with("::") && out[path..].ends_with(is_ident) {
            out.truncate(path);
            rest = &rest[2..];
            continue;
        }
        out.push(c);
        if !is_ident(c) {
            path = out.len();
        }
        rest = &rest[c.len_utf8()..];
    }
    out
}

pub(crate) type CallResult = Result<Value, Failure>;
type BlockingFn = dyn Fn(&[u8], Vec<IncomingTensor>) -> CallResult + Send + Sync;
type AsyncFn = dyn Fn(&[u8], Vec<IncomingTensor>) -> BoxFuture<CallResult> + Send + Sync;

/// How a registered function runs on the callee.
#[derive(Clone)]
pub(crate) enum Body {
    /// On the blocking thread pool: may block and may make nested `rpc_sync` calls.
    Blocking(Arc<BlockingFn>),
    /// As a task on the agent's runtime: must not block; nests with `rpc_async(..).await`.
    Async(Arc<AsyncFn>),
}

/// One registered function.
#[derive(Clone)]
pub(crate) struct Function {
    pub(crate) signature: Signature,
    pub(crate) body: Body,
}

/// The registry of remote functions a worker serves.
///
/// Arguments and results need only be `Send`: a result is encoded into
/// its reply on one thread at a time ([`Value`]). (An RRef's owner that
/// keeps a result and hands it out by reference asks for `Sync` there.)
///
/// Register the same functions under the same names on every worker (the
/// usual way is one function that builds the registry, called by every
/// process), then pass it in the options. Each is registered through its
/// typed [`Function`](crate::Function) declaration with
/// [`add`](Self::add), whose body may be plain, fallible or async
/// ([`Reply`]).
///
/// ```
/// use ferry_rpc::{Function, Functions};
///
/// const ADD: Function<(i64, i64), i64> = Function::new("add");
/// const DIV: Function<(f64, f64), f64> = Function::new("div");
/// const GREET: Function<String, String> = Function::new("greet");
///
/// let mut functions = Functions::new();
/// functions
///     .add(ADD, |(a, b)| a + b)
///     .add(DIV, |(a, b)| if b == 0.0 { Err("division by zero") } else { Ok(a / b) })
///     .add(GREET, |name| async move { format!("hello, {name}") });
/// assert_eq!(functions.names(), ["add", "div", "greet"]);
/// ```
///
/// Functions known only once the worker runs (a Python program defining
/// them as it goes) are added to a [`LateFunctions`] it also serves
/// ([`serve_late`](Self::serve_late)).
#[derive(Clone, Default)]
pub struct Functions {
    map: HashMap<String, Function>,
    /// Looked up for a name `map` lacks.
    late: Option<LateFunctions>,
}

impl Functions {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers `body` under `name` with `signature`: on the blocking pool,
    /// or as a task on the runtime when its reply is async ([`Reply::ASYNC`]).
    pub(crate) fn insert_body<A, R, F, O, M>(
        &mut self,
        name: &str,
        signature: Signature,
        body: F,
    ) -> &mut Self
    where
        A: DeserializeOwned + Send + 'static,
        R: Serialize + Send + 'static,
        F: Fn(A) -> O + Send + Sync + 'static,
        O: Reply<R, M>,
    {
        let body = if O::ASYNC {
            let f = Arc::new(body);
            let run = move |bytes: &[u8], tensors: Vec<IncomingTensor>| -> BoxFuture<CallResult> {
                let (args, before) = watch::decoding_arguments(|| decode_args::<A>(bytes, tensors));
                let f = f.clone();
                Box::pin(async move {
                    let args = args?;
                    if !before.is_empty() {
                        before.wait().await.map_err(Failure::failed)?;
                    }
                    let outcome = f(args).into_outcome();
                    let result = match outcome {
                        Outcome::Ready(result) => result,
                        Outcome::Pending(future) => future.await,
                    };
                    result.map(Value::new).map_err(Failure::failed)
                })
            };
            Body::Async(Arc::new(run))
        } else {
            let run = move |bytes: &[u8], tensors: Vec<IncomingTensor>| -> CallResult {
                let (args, before) = watch::decoding_arguments(|| decode_args::<A>(bytes, tensors));
                let args = args?;
                if !before.is_empty() {
                    before.block().map_err(Failure::failed)?;
                }
                let outcome = catch_unwind(AssertUnwindSafe(|| match body(args).into_outcome() {
                    Outcome::Ready(result) => result,
                    // A reply that says it is not async but is: waited
                    // for here, on the blocking pool.
                    Outcome::Pending(future) => futures::executor::block_on(future),
                }));
                match outcome {
                    Ok(result) => result.map(Value::new).map_err(Failure::failed),
                    Err(panic) => Err(Failure::failed(panic_message(&*panic))),
                }
            };
            Body::Blocking(Arc::new(run))
        };
        self.insert(name, Function { signature, body })
    }

    /// Whether a function is registered under `name`, here or (now) in
    /// the [`LateFunctions`] this registry serves.
    pub fn contains(&self, name: &str) -> bool {
        self.map.contains_key(name)
            || self
                .late
                .as_ref()
                .is_some_and(|late| late.0.read().map.contains_key(name))
    }

    /// The names registered here, sorted (not those of the
    /// [`LateFunctions`] it serves, which may change at any time).
    pub fn names(&self) -> Vec<&str> {
        let mut v: Vec<&str> = self.map.keys().map(String::as_str).collect();
        v.sort_unstable();
        v
    }

    /// Serves the functions `late` holds too, those added to it later
    /// included: a call of a name not registered here is looked up there
    /// when it arrives. A name registered here is never looked up there.
    /// Replaces the registry an earlier call gave.
    ///
    /// ```
    /// use ferry_rpc::{Function, Functions, LateFunctions};
    ///
    /// const LATER: Function<i64, i64> = Function::new("later");
    ///
    /// let late = LateFunctions::new();
    /// let mut functions = Functions::new();
    /// functions.serve_late(late.clone());
    /// assert!(!functions.contains("later"));
    /// // Once the agent runs with `functions`, say.
    /// late.update(|f| {
    ///     f.add(LATER, |x| x + 1);
    /// });
    /// assert!(functions.contains("later"));
    /// ```
    pub fn serve_late(&mut self, late: LateFunctions) -> &mut Self {
        self.late = Some(late);
        self
    }

    /// The function registered under `name`: here (borrowed), or a copy of
    /// the one the [`LateFunctions`] hold now.
    pub(crate) fn get(&self, name: &str) -> Option<Cow<'_, Function>> {
        if let Some(f) = self.map.get(name) {
            return Some(Cow::Borrowed(f));
        }
        let late = self.late.as_ref()?.0.read();
        late.map.get(name).cloned().map(Cow::Owned)
    }

    pub(crate) fn insert(&mut self, name: &str, f: Function) -> &mut Self {
        self.map.insert(name.to_string(), f);
        self
    }
}

/// A registry of remote functions shared with the agents that serve it
/// ([`Functions::serve_late`]): a function added to it while they run is
/// served from then on, one removed is unknown from then on (a call
/// already running finishes). For bindings whose functions are defined as
/// the program goes (a Python worker registering one after `init_rpc`);
/// a call of a name before it is added fails as any call of an unknown
/// function does. Clones share the registry.
#[derive(Clone, Default)]
pub struct LateFunctions(Arc<parking_lot::RwLock<Functions>>);

impl LateFunctions {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Runs `update` on the registry (to add, replace or remove
    /// functions) and returns what it returns; calls arriving afterwards
    /// see the change. A [`LateFunctions`] the registry itself is given to
    /// serve is not looked up through it.
    pub fn update<T>(&self, update: impl FnOnce(&mut Functions) -> T) -> T {
        update(&mut self.0.write())
    }

    /// Removes the function registered under `name`; whether there was one.
    pub fn remove(&self, name: &str) -> bool {
        self.0.write().map.remove(name).is_some()
    }

    /// The names registered now, sorted.
    pub fn names(&self) -> Vec<String> {
        let mut v: Vec<String> = self.0.read().map.keys().cloned().collect();
        v.sort_unstable();
        v
    }
}

impl std::fmt::Debug for LateFunctions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_set().entries(self.names()).finish()
    }
}

impl std::fmt::Debug for Functions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_set().entries(self.names()).finish()
    }
}

fn decode_args<A: DeserializeOwned>(
    bytes: &[u8],
    tensors: Vec<IncomingTensor>,
) -> Result<A, Failure> {
    payload::decode(bytes, tensors).map_err(|e| {
        Failure::new(
            FailureKind::BadArguments,
            format!("cannot decode the arguments: {e}"),
        )
    })
}

/// The text of a caught panic's payload, as `"panicked: {message}"` (how
/// a panicking function body's error reads): for layers that run user or
/// library code on their own threads and report its panics as errors.
pub fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    let text = panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic payload".into());
    format!("panicked: {text}")
}
