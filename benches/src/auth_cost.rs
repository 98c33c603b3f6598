//! What authentication costs, side by side in one run: a group without a
//! secret, with one (every byte after the handshake in records with a
//! MAC), and with `FERRY_AUTH=encrypt` (records sealed with an AEAD).
//! Both ends are Ferry's `PeerConnection` over loopback in one process,
//! as between two workers, frames on TCP:
//!
//! - connection set-up, and one empty round trip (`inline` channel);
//! - empty requests with 64 in flight (calls/s);
//! - one round trip of a 4 MB and of a 40 MB tensor over `mpt` (a reply
//!   of no bytes), its lanes sealed like the connection.
//!
//! Each repetition measures the three protections in a rotated order, so
//! drift hits all alike; ratios to "no secret" are taken within a
//! repetition and reported as their median and spread.

use std::sync::Arc;
use std::time::Instant;

use anyhow::Result;
use ferry::transport::auth::{Protection, Secret};
use ferry::transport::{channel, Endpoint, OutgoingMessage, PeerConnection, RawTensor};
use ferry::wire::{Flags, MessageKind};
use serde_json::{json, Value};
use tokio::net::TcpListener;

use crate::{stats_ms, Std};

/// The three groups compared, by their key in the result.
const SIDES: [&str; 3] = ["none", "mac", "encrypt"];
/// Requests in flight for the throughput figure.
const IN_FLIGHT: usize = 64;
/// Tensor sizes over `mpt`, in bytes.
const MPT_SIZES: [(usize, &str); 2] = [(4 << 20, "4MB"), (40 << 20, "40MB")];

fn secret_of(side: &str) -> Result<Option<Secret>> {
    let secret = Secret::new(b"benchmark secret, 32 bytes long.".to_vec())?;
    Ok(match side {
        "mac" => Some(secret.with_protection(Protection::Mac)),
        "encrypt" => Some(secret.with_protection(Protection::Encrypt)),
        _ => None,
    })
}

fn endpoint(name: &str, rank: u32, secret: Option<&Secret>, channels: &str) -> Result<Endpoint> {
    let mut e = Endpoint::new(name, rank);
    e.channels = channel::parse_channels(channels)?;
    e.transports = channel::parse_transports("tcp")?;
    e.config.small_tensor_bytes = 0;
    e.auth = secret.cloned();
    Ok(e)
}

async fn connect_pair(
    listener: &TcpListener,
    server: &Endpoint,
    client: &Endpoint,
) -> Result<(PeerConnection, PeerConnection)> {
    let addr = listener.local_addr()?;
    let (accepted, connected) = tokio::join!(
        async {
            let (s, _) = listener.accept().await?;
            Ok::<_, anyhow::Error>(PeerConnection::accept(s, server).await?)
        },
        PeerConnection::connect(addr, client)
    );
    Ok((accepted?, connected?))
}

fn request(id: u64, tensor: Option<&RawTensor>) -> OutgoingMessage {
    OutgoingMessage {
        kind: MessageKind::REQUEST,
        flags: Flags::NONE,
        request_id: id,
        payload: Vec::new(),
        tensors: tensor
            .map(|t| vec![Arc::new(t.clone()) as Arc<dyn ferry::wire::OutgoingTensor>])
            .unwrap_or_default(),
    }
}

/// A callee answering every request with an empty reply.
fn echo(mut callee: PeerConnection) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        while let Ok(Some(m)) = callee.reader.read().await {
            let mut reply = request(m.header.request_id, None);
            reply.flags = Flags::REPLY;
            if callee.writer.write(&reply).await.is_err() {
                break;
            }
        }
    })
}

/// One side's per-call figures in one repetition: set-up, round trip,
/// throughput.
async fn measure_calls(side: &str, setups: usize, calls: usize) -> Result<Value> {
    let secret = secret_of(side)?;
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let server = endpoint("callee", 1, secret.as_ref(), "inline")?;
    let client = endpoint("caller", 0, secret.as_ref(), "inline")?;
    let mut setup = Vec::with_capacity(setups);
    for _ in 0..setups {
        let s = Instant::now();
        let pair = connect_pair(&listener, &server, &client).await?;
        setup.push(s.elapsed().as_secs_f64());
        drop(pair);
    }
    let (callee, mut caller) = connect_pair(&listener, &server, &client).await?;
    let echoing = echo(callee);
    let mut round_trip = Vec::with_capacity(calls);
    for id in 0..(calls + calls / 10) as u64 {
        let s = Instant::now();
        caller.writer.write(&request(id, None)).await?;
        caller
            .reader
            .read()
            .await?
            .ok_or_else(|| anyhow::anyhow!("the callee closed"))?;
        if id as usize >= calls / 10 {
            round_trip.push(s.elapsed().as_secs_f64());
        }
    }
    // Throughput: IN_FLIGHT requests outstanding, a new one per reply.
    let total = calls * 2;
    let s = Instant::now();
    for id in 0..IN_FLIGHT as u64 {
        caller.writer.write(&request(id, None)).await?;
    }
    let mut sent = IN_FLIGHT;
    for _ in 0..total {
        caller
            .reader
            .read()
            .await?
            .ok_or_else(|| anyhow::anyhow!("the callee closed"))?;
        if sent < total {
            caller.writer.write(&request(sent as u64, None)).await?;
            sent += 1;
        }
    }
    let calls_per_s = total as f64 / s.elapsed().as_secs_f64();
    drop(caller);
    let _ = echoing.await;
    Ok(json!({
        "setup": stats_ms(&setup, Std::Population),
        "round_trip": stats_ms(&round_trip, Std::Population),
        "throughput": {"calls_per_s": calls_per_s, "in_flight": IN_FLIGHT},
    }))
}

/// One side's bulk figures in one repetition: round trips of tensors
/// over `mpt`.
async fn measure_bulk(side: &str, bulk: usize) -> Result<Value> {
    let secret = secret_of(side)?;
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let server = endpoint("callee", 1, secret.as_ref(), "mpt")?;
    let client = endpoint("caller", 0, secret.as_ref(), "mpt")?;
    let (callee, mut caller) = connect_pair(&listener, &server, &client).await?;
    let echoing = echo(callee);
    let mut mpt = serde_json::Map::new();
    for (bytes, label) in MPT_SIZES {
        let tensor = crate::test_tensor(bytes / 4)?;
        let mut times = Vec::with_capacity(bulk);
        for id in 0..=bulk as u64 {
            let s = Instant::now();
            caller.writer.write(&request(id, Some(&tensor))).await?;
            caller
                .reader
                .read()
                .await?
                .ok_or_else(|| anyhow::anyhow!("the callee closed"))?;
            if id > 0 {
                times.push(s.elapsed().as_secs_f64());
            }
        }
        mpt.insert(label.into(), stats_ms(&times, Std::Population));
    }
    drop(caller);
    let _ = echoing.await;
    Ok(json!({ "mpt": mpt }))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// The median and spread of one figure over the repetitions.
fn spread(values: Vec<f64>) -> Value {
    let lo = values.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    json!({"median": median(values.clone()), "min": lo, "max": hi, "runs": values})
}

/// `{"none": {...}, "mac": {...}, "encrypt": {...}, "ratios": {...}}`:
/// per side the median over repetitions of each figure (`setup` and
/// `round_trip` in ms, `throughput` in calls/s, `mpt` per size in ms),
/// and per protected side its cost against no secret within each
/// repetition (`round_trip_added_us`, `throughput_ratio`, `mpt_<size>`
/// time ratios), as median, min and max.
pub fn auth_cost(quick: bool) -> Result<Value> {
    let (setups, calls, bulk, reps) = if quick {
        (50, 2_000, 3, 1)
    } else {
        (300, 10_000, 10, 3)
    };
    // Calls on one thread, as the round-trip figures elsewhere (a wake-up
    // across threads costs a VM tens of microseconds, which would drown
    // the difference); bulk transfers on two, so that both ends hash in
    // parallel as two processes do.
    let calls_rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let bulk_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let mut runs: Vec<serde_json::Map<String, Value>> = Vec::with_capacity(reps);
    for rep in 0..reps {
        let mut run = serde_json::Map::new();
        for k in 0..SIDES.len() {
            let side = SIDES[(rep + k) % SIDES.len()];
            let mut v = calls_rt.block_on(measure_calls(side, setups, calls))?;
            let b = bulk_rt.block_on(measure_bulk(side, bulk))?;
            v["mpt"] = b["mpt"].clone();
            run.insert(side.into(), v);
        }
        runs.push(run);
    }
    let figure = |run: &serde_json::Map<String, Value>, side: &str, ptr: &str| {
        run[side]
            .pointer(ptr)
            .and_then(Value::as_f64)
            .unwrap_or(f64::NAN)
    };
    let mut out = serde_json::Map::new();
    let mut pointers = vec![
        "/setup/median_ms".to_string(),
        "/round_trip/median_ms".to_string(),
        "/throughput/calls_per_s".to_string(),
    ];
    pointers.extend(MPT_SIZES.iter().map(|(_, l)| format!("/mpt/{l}/median_ms")));
    for side in SIDES {
        let mut v = json!({});
        for ptr in &pointers {
            let m = median(runs.iter().map(|r| figure(r, side, ptr)).collect());
            // Rebuild the pointer's path in the summary.
            let parts: Vec<&str> = ptr.trim_start_matches('/').split('/').collect();
            let mut at = &mut v;
            for p in &parts[..parts.len() - 1] {
                at = at
                    .as_object_mut()
                    .map(|o| o.entry(p.to_string()).or_insert_with(|| json!({})))
                    .unwrap_or_else(|| unreachable!("objects all the way down"));
            }
            at[parts[parts.len() - 1]] = json!(m);
        }
        out.insert(side.into(), v);
    }
    let mut ratios = serde_json::Map::new();
    for side in ["mac", "encrypt"] {
        let mut r = serde_json::Map::new();
        r.insert(
            "round_trip_added_us".into(),
            spread(
                runs.iter()
                    .map(|run| {
                        1e3 * (figure(run, side, "/round_trip/median_ms")
                            - figure(run, "none", "/round_trip/median_ms"))
                    })
                    .collect(),
            ),
        );
        r.insert(
            "throughput_ratio".into(),
            spread(
                runs.iter()
                    .map(|run| {
                        figure(run, side, "/throughput/calls_per_s")
                            / figure(run, "none", "/throughput/calls_per_s")
                    })
                    .collect(),
            ),
        );
        for (_, label) in MPT_SIZES {
            let ptr = format!("/mpt/{label}/median_ms");
            r.insert(
                format!("mpt_{label}"),
                spread(
                    runs.iter()
                        .map(|run| figure(run, side, &ptr) / figure(run, "none", &ptr))
                        .collect(),
                ),
            );
        }
        ratios.insert(side.into(), Value::Object(r));
    }
    out.insert("ratios".into(), Value::Object(ratios));
    out.insert(
        "config".into(),
        json!({"setups": setups, "calls": calls, "bulk": bulk, "repetitions": reps}),
    );
    Ok(Value::Object(out))
}
