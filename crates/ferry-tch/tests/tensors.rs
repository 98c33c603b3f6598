//! Multi-process tests of libtorch tensors on the wire: two worker
//! processes on 127.0.0.1, rank 0 sends, rank 1 echoes or computes.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;

use ferry_rpc::{Function, Functions, RpcOptions, Schema};
use ferry_tch::{kind_of, Tensor};
use ferry_testkit::world_ok;
use ferry_wire::DType;
use serde::{Deserialize, Serialize};
use tch::{Device, Kind};

/// Tensors inside nested containers.
#[derive(Debug, Clone, Serialize, Deserialize, Schema)]
struct Batch {
    name: String,
    inputs: Vec<Tensor>,
    by_key: BTreeMap<String, (u32, Tensor)>,
    maybe: Option<Tensor>,
}

const ECHO: Function<Tensor, Tensor> = Function::new("echo");
const ECHO_ALL: Function<Vec<Tensor>, Vec<Tensor>> = Function::new("echo_all");
const ECHO_BATCH: Function<Batch, Batch> = Function::new("echo_batch");
const ADD: Function<(Tensor, Tensor), Tensor> = Function::new("add");
/// Size, stride, contiguity and `requires_grad` of the tensor received.
const DESCRIBE: Function<Tensor, Description> = Function::new("describe");
const RAW_SUM: Function<Tensor, f64> = Function::new("raw_sum");
/// OpenMP's thread count on the thread running it (what MKL's GEMMs use).
const OMP_THREADS: Function<(), i32> = Function::new("omp_threads");

/// Size, stride, contiguity and `requires_grad`.
type Description = (Vec<i64>, Vec<i64>, bool, bool);

fn functions() -> Functions {
    let mut f = Functions::new();
    f.add(ECHO, |t| t);
    f.add(ECHO_ALL, |ts| ts);
    f.add(ECHO_BATCH, |b| b);
    f.add(ADD, |(a, b)| Tensor::from(&*a + &*b));
    f.add(DESCRIBE, |t| {
        (t.size(), t.stride(), t.is_contiguous(), t.requires_grad())
    });
    f.add(RAW_SUM, |t| t.sum(Kind::Double).double_value(&[]));
    f.add(OMP_THREADS, |()| omp_max_threads());
    f
}

/// `omp_get_max_threads()` of the OpenMP runtime libtorch loaded, on this
/// thread.
fn omp_max_threads() -> i32 {
    // SAFETY: a lookup in the libraries already loaded; the symbol, when
    // found, is OpenMP's `int omp_get_max_threads(void)`.
    let f = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"omp_get_max_threads".as_ptr()) };
    assert!(!f.is_null(), "libtorch loaded no OpenMP runtime");
    // SAFETY: as above.
    let f: extern "C" fn() -> i32 = unsafe { std::mem::transmute(f) };
    f()
}

fn init(rank: u32) {
    let mut options = RpcOptions::from_env(format!("worker{rank}"))
        .unwrap()
        .functions(functions());
    ferry_tch::install(&mut options);
    init_rpc(options).unwrap();
}

fn same(a: &tch::Tensor, b: &tch::Tensor) -> bool {
    a.kind() == b.kind() && a.size() == b.size() && a.equal(b)
}

/// A tensor of `kind` with distinct values (bit patterns for the float8 kinds).
fn sample(kind: Kind, shape: &[i64]) -> tch::Tensor {
    let n: i64 = shape.iter().product();
    let base = tch::Tensor::arange(n, (Kind::Int64, Device::Cpu)).remainder(100);
    match kind {
        Kind::Bool => base.remainder(2).to_kind(Kind::Bool).reshape(shape),
        Kind::Float8e5m2 | Kind::Float8e4m3fn | Kind::Float8e5m2fnuz | Kind::Float8e4m3fnuz => {
            // Build from the bytes: libtorch has few ops on float8 kinds.
            base.to_kind(Kind::Uint8).view_dtype(kind).reshape(shape)
        }
        Kind::ComplexHalf => base
            .to_kind(Kind::Float)
            .view_as_complex_helper()
            .to_kind(Kind::ComplexHalf)
            .reshape(shape),
        _ => base.to_kind(kind).reshape(shape),
    }
}

trait ComplexHelper {
    fn view_as_complex_helper(&self) -> tch::Tensor;
}
impl ComplexHelper for tch::Tensor {
    fn view_as_complex_helper(&self) -> tch::Tensor {
        tch::Tensor::complex(self, &(self * 2.0))
    }
}

fn bytes_equal(a: &tch::Tensor, b: &tch::Tensor) -> bool {
    let a = a.contiguous().view_dtype(Kind::Uint8);
    let b = b.contiguous().view_dtype(Kind::Uint8);
    a.size() == b.size() && a.equal(&b)
}

/// The functions run with the intra-op thread count the process set, not
/// OpenMP's default for a new thread (every core).
#[test]
fn functions_run_with_the_process_thread_count() {
    world_ok("functions_run_with_the_process_thread_count", 2, |rank| {
        let cores = std::thread::available_parallelism().unwrap().get() as i32;
        // Not what a new thread gets by default.
        let wanted = cores + 1;
        tch::set_num_threads(wanted);
        init(rank);
        if rank == 0 {
            if std::env::var_os("OMP_NUM_THREADS").is_none() {
                // A thread libtorch has not touched gets OpenMP's default.
                let plain = std::thread::spawn(omp_max_threads).join().unwrap();
                assert_eq!(plain, cores);
            }
            for to in [0, 1] {
                let calls: Vec<_> = (0..4).map(|_| OMP_THREADS.rpc_async(to, ())).collect();
                for call in calls {
                    assert_eq!(call.wait().unwrap(), wanted, "a function on worker{to}");
                }
            }
        }
        ferry_rpc::shutdown().unwrap();
    });
}

#[test]
fn every_dtype_round_trips() {
    world_ok("every_dtype_round_trips", 2, |rank| {
        init(rank);
        if rank == 0 {
            for dtype in DType::ALL {
                let kind = kind_of(dtype);
                let t = sample(kind, &[3, 4]);
                let back: Tensor = ECHO
                    .rpc_sync("worker1", Tensor::from(t.shallow_clone()))
                    .unwrap();
                assert_eq!(back.kind(), kind, "{dtype}");
                assert_eq!(back.size(), [3, 4], "{dtype}");
                assert!(bytes_equal(&back, &t), "{dtype} bytes differ");
            }
            // Empty and scalar tensors.
            for shape in [&[0i64, 5][..], &[][..], &[1][..]] {
                let t = tch::Tensor::ones(shape, (Kind::Float, Device::Cpu));
                let back: Tensor = ECHO
                    .rpc_sync("worker1", Tensor::from(t.shallow_clone()))
                    .unwrap();
                assert!(same(&back, &t), "shape {shape:?}");
            }
        }
        ferry_rpc::shutdown().unwrap();
    });
}

#[test]
fn views_arrive_as_the_same_views_and_values_compute() {
    world_ok(
        "views_arrive_as_the_same_views_and_values_compute",
        2,
        |rank| {
            init(rank);
            if rank == 0 {
                let base = tch::Tensor::arange(24, (Kind::Float, Device::Cpu)).reshape([4, 6]);
                // Transposed, sliced with a step, and an expanded (stride 0) view.
                let views = [
                    base.tr(),
                    base.slice(1, 1, 6, 2),
                    tch::Tensor::arange(3, (Kind::Float, Device::Cpu))
                        .reshape([3, 1])
                        .expand([3, 5], false),
                ];
                for v in views {
                    let (size, stride, contiguous, _): (Vec<i64>, Vec<i64>, bool, bool) = DESCRIBE
                        .rpc_sync("worker1", Tensor::from(v.shallow_clone()))
                        .unwrap();
                    assert_eq!(size, v.size());
                    assert_eq!(stride, v.stride(), "the view keeps its strides");
                    assert_eq!(contiguous, v.is_contiguous());
                    let back: Tensor = ECHO
                        .rpc_sync("worker1", Tensor::from(v.shallow_clone()))
                        .unwrap();
                    assert!(same(&back, &v));
                }
                let a = tch::Tensor::randn([8, 8], (Kind::Double, Device::Cpu));
                let b = tch::Tensor::randn([8, 8], (Kind::Double, Device::Cpu));
                let sum: Tensor = ADD
                    .rpc_sync(
                        "worker1",
                        (
                            Tensor::from(a.shallow_clone()),
                            Tensor::from(b.shallow_clone()),
                        ),
                    )
                    .unwrap();
                assert!(same(&sum, &(&a + &b)));
            }
            ferry_rpc::shutdown().unwrap();
        },
    );
}

#[test]
fn many_tensors_in_nested_containers() {
    world_ok("many_tensors_in_nested_containers", 2, |rank| {
        init(rank);
        if rank == 0 {
            let sizes = [0i64, 1, 7, 1000, 65_536, 1 << 20];
            let inputs: Vec<Tensor> = sizes
                .iter()
                .map(|&n| Tensor::from(tch::Tensor::randn([n], (Kind::Float, Device::Cpu))))
                .collect();
            let mut by_key = BTreeMap::new();
            by_key.insert(
                "a".to_string(),
                (
                    1u32,
                    Tensor::from(tch::Tensor::ones([2, 3], (Kind::Int64, Device::Cpu))),
                ),
            );
            by_key.insert(
                "b".to_string(),
                (2u32, Tensor::from(sample(Kind::BFloat16, &[5]))),
            );
            let batch = Batch {
                name: "batch".into(),
                inputs,
                by_key,
                maybe: Some(Tensor::from(tch::Tensor::zeros(
                    [3],
                    (Kind::Half, Device::Cpu),
                ))),
            };
            let back: Batch = ECHO_BATCH.rpc_sync("worker1", batch.clone()).unwrap();
            assert_eq!(back.name, "batch");
            assert_eq!(back.inputs.len(), sizes.len());
            for (x, y) in back.inputs.iter().zip(&batch.inputs) {
                assert!(same(x, y));
            }
            for (k, (n, t)) in &batch.by_key {
                let (m, u) = &back.by_key[k];
                assert_eq!(n, m);
                assert!(same(t, u));
            }
            assert!(same(
                back.maybe.as_ref().unwrap(),
                batch.maybe.as_ref().unwrap()
            ));
            // Many concurrent calls with tensors of different sizes.
            let futures: Vec<_> = (0..32i64)
                .map(|i| {
                    let t = tch::Tensor::full([i * 1000 + 1], i as f64, (Kind::Float, Device::Cpu));
                    (
                        t.shallow_clone(),
                        ECHO.rpc_async("worker1", Tensor::from(t)),
                    )
                })
                .collect();
            for (t, f) in futures {
                assert!(same(&f.wait().unwrap(), &t));
            }
        }
        ferry_rpc::shutdown().unwrap();
    });
}

#[test]
fn other_allocators_and_bad_input() {
    world_ok("other_allocators_and_bad_input", 2, |rank| {
        if rank == 0 {
            init(rank);
        } else {
            // Worker 1 keeps the default allocator (raw host memory).
            let options = RpcOptions::from_env("worker1")
                .unwrap()
                .functions(functions());
            init_rpc(options).unwrap();
        }
        if rank == 0 {
            // Received by another allocator, a Tensor still decodes (one copy).
            let t = tch::Tensor::from_slice(&[1.5f64, 2.5, 3.0]);
            let sum: f64 = RAW_SUM.rpc_sync("worker1", Tensor::from(t)).unwrap();
            assert_eq!(sum, 7.0);
            let back: Tensor = ECHO
                .rpc_sync("worker1", Tensor::from(sample(Kind::Int16, &[2, 3])))
                .unwrap();
            assert!(same(&back, &sample(Kind::Int16, &[2, 3])));
            // Received tensors do not require grad outside distributed autograd.
            let t = tch::Tensor::ones([2], (Kind::Float, Device::Cpu)).set_requires_grad(true);
            let (_, _, _, requires_grad): (Vec<i64>, Vec<i64>, bool, bool) =
                DESCRIBE.rpc_sync("worker1", Tensor::from(t)).unwrap();
            assert!(!requires_grad);
            // An undefined tensor is refused with a clear error, before sending.
            let err = ECHO
                .rpc_sync("worker1", Tensor::from(tch::Tensor::new()))
                .unwrap_err();
            assert!(err.to_string().contains("undefined tensor"), "{err}");
            // A quantized tensor is refused, naming its kind.
            let q = tch::Tensor::ones([2], (Kind::Float, Device::Cpu)).quantize_per_tensor(
                0.1,
                0,
                Kind::QInt8,
            );
            let err = ECHO.rpc_sync("worker1", Tensor::from(q)).unwrap_err();
            assert!(err.to_string().contains("QInt8"), "{err}");
        }
        ferry_rpc::shutdown().unwrap();
    });
}

/// Starts this process's agent and makes it the process's (what
/// `ferry::init_rpc` does, with only the layers `options` has).
fn init_rpc(options: ferry_rpc::RpcOptions) -> Result<ferry_rpc::Agent, ferry_rpc::RpcError> {
    let agent = ferry_rpc::Agent::start(options)?;
    ferry_rpc::set_process_agent(&agent)?;
    Ok(agent)
}
