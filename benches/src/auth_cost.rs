//! What authentication costs: connection set-up and one round trip on an
//! established connection, each with and without the group's secret, over
//! loopback in one process (both ends are Ferry's `PeerConnection`, as
//! between two workers; `inline` channel on TCP so only the handshake
//! differs). After the handshake an authenticated connection runs the very
//! same frame path, so the per-call numbers should match.

use std::time::Instant;

use anyhow::Result;
use ferry::transport::auth::Secret;
use ferry::transport::{channel, Endpoint, OutgoingMessage, PeerConnection};
use ferry::wire::{Flags, MessageKind};
use serde_json::{json, Value};
use tokio::net::TcpListener;

use crate::{stats_ms, Std};

fn endpoint(name: &str, rank: u32, secret: Option<&Secret>) -> Result<Endpoint> {
    let mut e = Endpoint::new(name, rank);
    e.channels = channel::parse_channels("inline")?;
    e.transports = channel::parse_transports("tcp")?;
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

fn empty(id: u64) -> OutgoingMessage {
    OutgoingMessage {
        kind: MessageKind::REQUEST,
        flags: Flags::NONE,
        request_id: id,
        payload: Vec::new(),
        tensors: Vec::new(),
    }
}

/// Median set-up and round-trip times with `secret` (or none).
async fn measure(secret: Option<&Secret>, setups: usize, calls: usize) -> Result<Value> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let server = endpoint("callee", 1, secret)?;
    let client = endpoint("caller", 0, secret)?;
    let mut setup = Vec::with_capacity(setups);
    for _ in 0..setups {
        let s = Instant::now();
        let pair = connect_pair(&listener, &server, &client).await?;
        setup.push(s.elapsed().as_secs_f64());
        drop(pair);
    }
    let (mut callee, mut caller) = connect_pair(&listener, &server, &client).await?;
    let echo = tokio::spawn(async move {
        while let Ok(Some(m)) = callee.reader.read().await {
            let mut reply = empty(m.header.request_id);
            reply.flags = Flags::REPLY;
            if callee.writer.write(&reply).await.is_err() {
                break;
            }
        }
    });
    let mut round_trip = Vec::with_capacity(calls);
    for id in 0..(calls + calls / 10) as u64 {
        let s = Instant::now();
        caller.writer.write(&empty(id)).await?;
        caller
            .reader
            .read()
            .await?
            .ok_or_else(|| anyhow::anyhow!("the callee closed"))?;
        if id as usize >= calls / 10 {
            round_trip.push(s.elapsed().as_secs_f64());
        }
    }
    drop(caller);
    let _ = echo.await;
    Ok(json!({
        "setup": stats_ms(&setup, Std::Population),
        "round_trip": stats_ms(&round_trip, Std::Population),
    }))
}

/// `{"none": {...}, "secret": {...}}`, each with `setup` and `round_trip`
/// statistics in milliseconds.
pub fn auth_cost(quick: bool) -> Result<Value> {
    let (setups, calls) = if quick { (50, 2_000) } else { (500, 20_000) };
    let secret = Secret::new(b"benchmark secret, 32 bytes long.".to_vec())?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        // Interleaved so drift hits both alike.
        let none = measure(None, setups, calls).await?;
        let with = measure(Some(&secret), setups, calls).await?;
        Ok(json!({"none": none, "secret": with, "setups": setups, "calls": calls}))
    })
}
