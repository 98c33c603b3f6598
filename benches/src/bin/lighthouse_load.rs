//! A heartbeat load generator for any lighthouse speaking
//! `torchft.LighthouseService`: how many heartbeats per second the server
//! handles when the client is not the bottleneck.
//!
//! torchft's own `LighthouseClient` (driven from Python threads by
//! `../shared/peers/lighthouse_bench.py`) spends about 50 µs of CPU per
//! heartbeat, three to four times what either server spends, so on a small
//! machine its rate measures the client. This program sends the same
//! `Heartbeat` requests from one thread (a current-thread tokio runtime) over
//! `--connections` HTTP/2 connections with `--in-flight` requests outstanding
//! on each, the way many replica groups heartbeat one lighthouse, so the
//! rate it reports is set by the server. `cargo xtask bench --only
//! lighthouse` runs it against `ferry-lighthouse` and torchft's
//! `torchft_lighthouse` alike.
//!
//! Each shape `CxK` (connections × requests in flight on each) runs
//! `--warmup` seconds, then counts the heartbeats answered within the next
//! `--seconds`. Every replica id is distinct (`load{shape}_{c}_{k}`). Any
//! failed heartbeat ends the run with an error naming it.
//!
//! Usage: `lighthouse_load --addr http://HOST:PORT [--shapes 8x1 8x16]
//! [--seconds 3] [--warmup 0.5] [--out PATH]`. Writes one JSON object to
//! `--out` or stdout: `{"addr", "seconds", "heartbeats_per_s": {"8x1": ..,
//! "8x16": ..}}`.

use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};
use ferry_benches::write_result;
use ferry_ft::proto::lighthouse_service_client::LighthouseServiceClient;
use ferry_ft::proto::LighthouseHeartbeatRequest;
use serde_json::{json, Map, Value};
use tokio::time::Instant;
use tonic::transport::{Channel, Endpoint};

/// Bound on connecting to the lighthouse.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Bound on one heartbeat (a stuck server must still end the run).
const HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(30);

/// One load shape: `connections` HTTP/2 connections with `in_flight`
/// requests outstanding on each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Shape {
    connections: usize,
    in_flight: usize,
}

impl Shape {
    /// Parses `CxK`, both at least 1.
    fn parse(text: &str) -> Result<Self> {
        let (c, k) = text
            .split_once('x')
            .with_context(|| format!("shape {text:?} is not CONNECTIONSxIN_FLIGHT"))?;
        let number = |n: &str| -> Result<usize> {
            let n: usize = n
                .parse()
                .with_context(|| format!("shape {text:?}: {n:?} is not a number"))?;
            ensure!(n >= 1, "shape {text:?}: counts must be at least 1");
            Ok(n)
        };
        Ok(Self {
            connections: number(c)?,
            in_flight: number(k)?,
        })
    }

    fn label(self) -> String {
        format!("{}x{}", self.connections, self.in_flight)
    }
}

struct Config {
    addr: String,
    shapes: Vec<Shape>,
    seconds: f64,
    warmup: f64,
    out: Option<String>,
}

fn config() -> Result<Config> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut addr = None;
    let mut shapes = vec![Shape::parse("8x1")?, Shape::parse("8x16")?];
    let (mut seconds, mut warmup, mut out) = (3.0, 0.5, None);
    let mut i = 0;
    let seconds_arg = |i: usize, name: &str| -> Result<f64> {
        let v = args
            .get(i)
            .with_context(|| format!("{name} needs a number of seconds"))?;
        let s: f64 = v
            .parse()
            .with_context(|| format!("{name}: {v:?} is not a number"))?;
        ensure!(s.is_finite() && s >= 0.0, "{name}: {v:?} is not a duration");
        Ok(s)
    };
    while i < args.len() {
        match args[i].as_str() {
            "--addr" => {
                i += 1;
                let a = args.get(i).context("--addr needs an address")?;
                addr = Some(if a.starts_with("http") {
                    a.clone()
                } else {
                    format!("http://{a}")
                });
            }
            "--shapes" => {
                shapes.clear();
                while i + 1 < args.len() && !args[i + 1].starts_with("--") {
                    i += 1;
                    shapes.push(Shape::parse(&args[i])?);
                }
                ensure!(!shapes.is_empty(), "--shapes needs at least one CxK");
            }
            "--seconds" => {
                i += 1;
                seconds = seconds_arg(i, "--seconds")?;
                ensure!(seconds > 0.0, "--seconds must be more than 0");
            }
            "--warmup" => {
                i += 1;
                warmup = seconds_arg(i, "--warmup")?;
            }
            "--out" => {
                i += 1;
                out = Some(args.get(i).context("--out needs a path")?.clone());
            }
            other => bail!("unknown argument {other:?}"),
        }
        i += 1;
    }
    Ok(Config {
        addr: addr.context("--addr is required")?,
        shapes,
        seconds,
        warmup,
        out,
    })
}

/// Heartbeats answered within `[start, stop)` by one request stream that
/// sends `replica_id`'s heartbeats back to back until `stop`.
async fn stream(
    mut client: LighthouseServiceClient<Channel>,
    replica_id: String,
    start: Instant,
    stop: Instant,
) -> Result<u64> {
    let mut answered = 0;
    loop {
        let request = LighthouseHeartbeatRequest {
            replica_id: replica_id.clone(),
        };
        tokio::time::timeout(HEARTBEAT_TIMEOUT, client.heartbeat(request))
            .await
            .with_context(|| {
                format!("heartbeat of {replica_id}: no answer in {HEARTBEAT_TIMEOUT:?}")
            })?
            .with_context(|| format!("heartbeat of {replica_id} failed"))?;
        let now = Instant::now();
        if now >= stop {
            return Ok(answered);
        }
        if now >= start {
            answered += 1;
        }
    }
}

/// Heartbeats per second the lighthouse at `addr` answers under `shape`.
async fn measure(addr: &str, shape: Shape, warmup: f64, seconds: f64) -> Result<f64> {
    let endpoint = Endpoint::from_shared(addr.to_owned())
        .with_context(|| format!("{addr:?} is not a URL"))?
        .connect_timeout(CONNECT_TIMEOUT)
        .tcp_nodelay(true);
    let mut clients = Vec::with_capacity(shape.connections);
    for _ in 0..shape.connections {
        let channel = endpoint
            .connect()
            .await
            .with_context(|| format!("cannot connect to the lighthouse at {addr}"))?;
        clients.push(LighthouseServiceClient::new(channel));
    }
    let start = Instant::now() + Duration::from_secs_f64(warmup);
    let stop = start + Duration::from_secs_f64(seconds);
    let mut streams = tokio::task::JoinSet::new();
    for (c, client) in clients.iter().enumerate() {
        for k in 0..shape.in_flight {
            let replica_id = format!("load{}_{c}_{k}", shape.label());
            streams.spawn(stream(client.clone(), replica_id, start, stop));
        }
    }
    let mut answered = 0;
    while let Some(result) = streams.join_next().await {
        answered += result.context("a heartbeat stream panicked")??;
    }
    Ok(answered as f64 / seconds)
}

fn main() -> Result<()> {
    let c = config()?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the tokio runtime")?;
    let mut rates = Map::new();
    for &shape in &c.shapes {
        let rate = runtime.block_on(measure(&c.addr, shape, c.warmup, c.seconds))?;
        rates.insert(shape.label(), json!(rate.round()));
    }
    let result = json!({
        "addr": c.addr,
        "seconds": c.seconds,
        "heartbeats_per_s": Value::Object(rates),
    });
    write_result(&result, c.out.as_deref())
}

#[cfg(test)]
mod tests {
    use super::Shape;

    #[test]
    fn shapes_parse() {
        assert_eq!(
            Shape::parse("8x16").unwrap(),
            Shape {
                connections: 8,
                in_flight: 16
            }
        );
        assert_eq!(Shape::parse("1x1").unwrap().label(), "1x1");
        assert!(Shape::parse("8").is_err());
        assert!(Shape::parse("0x4").is_err());
        assert!(Shape::parse("ax4").is_err());
    }
}
