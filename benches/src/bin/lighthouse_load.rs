//! A heartbeat load generator for any lighthouse speaking
//! `torchft.LighthouseService`: how many heartbeats per second the server
//! handles when the client is not the bottleneck.
//!
//! torchft's own `LighthouseClient` (driven from Python threads by
//! `benches/peers/lighthouse_bench.py`) spends several times the CPU per
//! heartbeat that either server spends, so where cores are few its rate
//! measures the client. This program sends the same
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

use anyhow::{ensure, Context, Result};
use clap::Parser;
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

/// A heartbeat load generator for any `torchft.LighthouseService`.
#[derive(Debug, Parser)]
#[command(name = "lighthouse_load")]
struct Args {
    /// The lighthouse's address (`http://` is added when missing).
    #[arg(long, value_name = "ADDR")]
    addr: String,
    /// Load shapes, CONNECTIONSxIN_FLIGHT each.
    #[arg(long, num_args = 1.., value_parser = shape_arg, default_values = ["8x1", "8x16"])]
    shapes: Vec<Shape>,
    /// Seconds counted per shape.
    #[arg(long, default_value_t = 3.0, value_parser = positive_seconds)]
    seconds: f64,
    /// Seconds of warm-up before counting, per shape.
    #[arg(long, default_value_t = 0.5, value_parser = seconds_arg)]
    warmup: f64,
    /// Where to write the JSON result (stdout when absent).
    #[arg(long, value_name = "PATH")]
    out: Option<String>,
}

/// clap's parser for one `--shapes` value.
fn shape_arg(text: &str) -> Result<Shape, String> {
    Shape::parse(text).map_err(|e| format!("{e:#}"))
}

/// clap's parser for a duration in seconds (finite, not negative).
fn seconds_arg(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(s) if s.is_finite() && s >= 0.0 => Ok(s),
        _ => Err(format!("{text:?} is not a number of seconds")),
    }
}

/// [`seconds_arg`], more than 0.
fn positive_seconds(text: &str) -> Result<f64, String> {
    let seconds = seconds_arg(text)?;
    if seconds > 0.0 {
        Ok(seconds)
    } else {
        Err("must be more than 0 seconds".to_owned())
    }
}

struct Config {
    addr: String,
    shapes: Vec<Shape>,
    seconds: f64,
    warmup: f64,
    out: Option<String>,
}

fn config() -> Config {
    let args = Args::parse();
    Config {
        addr: if args.addr.starts_with("http") {
            args.addr
        } else {
            format!("http://{}", args.addr)
        },
        shapes: args.shapes,
        seconds: args.seconds,
        warmup: args.warmup,
        out: args.out,
    }
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
    let c = config();
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
