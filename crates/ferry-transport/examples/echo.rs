//! Embedding `ferry-transport` on its own: a tensor echo server and client.
//!
//! This example uses no RPC layer, only what another system would take from
//! Ferry to move tensors between processes:
//!
//! - the server accepts [`PeerConnection`]s on an ephemeral port of
//!   127.0.0.1; every message it receives carries a serde payload
//!   `(String, Vec<RawTensor>)`, and it answers with the same label and every
//!   f32 tensor doubled (other dtypes come back unchanged), keeping each
//!   tensor's view (shape, strides, offset);
//! - the client sends a few messages with tensors of different shapes,
//!   including a non-contiguous transposed view, prints the replies and
//!   checks every value.
//!
//! The tensors travel out of band: the payload holds only their table
//! indices, and their bytes go to the socket from their own memory.
//!
//! Run it with `cargo run -p ferry-transport --example echo`.

use std::error::Error;
use std::net::SocketAddr;
use std::sync::Arc;

use ferry_transport::{
    Endpoint, IncomingMessage, OutgoingMessage, PeerConnection, RawTensor, Storage,
};
use ferry_wire::{payload, DType, Flags, MessageKind, TensorDescriptor};
use tokio::net::TcpListener;

/// The example's error type: anything, sendable between tasks.
type BoxError = Box<dyn Error + Send + Sync>;

/// What travels each way: a label and a list of tensors.
type Message = (String, Vec<RawTensor>);

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    println!("echo server listening on {addr}");
    let server = tokio::spawn(serve(listener));

    run_client(addr).await?;

    // The client has closed its connection; the server would keep accepting
    // others, so stop it here.
    server.abort();
    println!("all replies checked");
    Ok(())
}

/// Accepts connections forever, one task per connection.
async fn serve(listener: TcpListener) -> Result<(), BoxError> {
    let endpoint = Endpoint::new("echo-server", 0);
    loop {
        let (stream, peer) = listener.accept().await?;
        let endpoint = endpoint.clone();
        tokio::spawn(async move {
            if let Err(e) = serve_connection(stream, &endpoint).await {
                eprintln!("connection from {peer} failed: {e}");
            }
        });
    }
}

/// Handshakes on one accepted socket, then answers every message until the
/// peer closes.
async fn serve_connection(
    stream: tokio::net::TcpStream,
    endpoint: &Endpoint,
) -> Result<(), BoxError> {
    let mut conn = PeerConnection::accept(stream, endpoint).await?;
    println!("server: {} connected", conn.peer.worker_name);
    while let Some(request) = conn.reader.read().await? {
        let reply = handle(request)?;
        conn.writer.write(&reply).await?;
    }
    println!("server: {} closed the connection", conn.peer.worker_name);
    Ok(())
}

/// Decodes a request, doubles its f32 tensors and encodes the reply.
fn handle(request: IncomingMessage) -> Result<OutgoingMessage, BoxError> {
    let (label, tensors): Message = payload::decode(&request.payload, request.tensors)?;
    let doubled = tensors.iter().map(double).collect::<Result<Vec<_>, _>>()?;
    let encoded = payload::encode(&(label, doubled))?;
    Ok(OutgoingMessage {
        kind: MessageKind::RESPONSE,
        flags: Flags::REPLY,
        request_id: request.header.request_id,
        payload: encoded.payload,
        tensors: encoded.tensors,
    })
}

/// Returns `t` with every f32 element doubled, as the same view over a new
/// storage; tensors of other dtypes are returned as they are.
fn double(t: &RawTensor) -> Result<RawTensor, BoxError> {
    if t.dtype() != DType::F32 {
        return Ok(t.clone());
    }
    // A received tensor's storage is exactly the span its view covers, so
    // doubling every element of the storage doubles the view.
    let src = t.storage().as_bytes();
    let mut storage = Storage::zeroed(src.len())?;
    for (out, chunk) in storage
        .as_bytes_mut()
        .chunks_exact_mut(4)
        .zip(src.chunks_exact(4))
    {
        let x = f32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]);
        out.copy_from_slice(&(2.0 * x).to_le_bytes());
    }
    let desc = TensorDescriptor {
        dtype: t.dtype(),
        shape: t.shape().into(),
        strides: t.strides().into(),
        storage_offset: t.storage_offset(),
        byte_len: storage.len() as u64,
        device: ferry_wire::Device::Cpu,
    };
    Ok(RawTensor::from_storage(Arc::new(storage), desc)?)
}

/// The elements of an f32 view in row-major order.
fn values(t: &RawTensor) -> Vec<f32> {
    t.to_contiguous_bytes()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// Connects, sends a few messages and checks the replies.
async fn run_client(addr: SocketAddr) -> Result<(), BoxError> {
    let mut conn = PeerConnection::connect(addr, &Endpoint::new("echo-client", 1)).await?;
    println!("client: connected to {}", conn.peer.worker_name);

    let grid = RawTensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3])?;
    let messages: Vec<Message> = vec![
        (
            "vector".into(),
            vec![RawTensor::from_slice(&[0.5f32, -1.0, 4.0], &[3])?],
        ),
        ("matrix".into(), vec![grid.clone()]),
        // A transposed view: shape [3, 2], strides [1, 3], not contiguous.
        ("transposed".into(), vec![grid.t()?]),
        (
            "mixed".into(),
            vec![
                RawTensor::from_slice(&[7i64, 8, 9], &[3])?,
                RawTensor::from_slice(&[0.25f32; 8], &[2, 2, 2])?,
                RawTensor::zeros(DType::F32, &[0, 4])?,
            ],
        ),
        ("no tensors".into(), Vec::new()),
    ];

    for (id, sent) in messages.iter().enumerate() {
        let encoded = payload::encode(sent)?;
        conn.writer
            .write(&OutgoingMessage {
                kind: MessageKind::REQUEST,
                flags: Flags::NONE,
                request_id: id as u64,
                payload: encoded.payload,
                tensors: encoded.tensors,
            })
            .await?;
        let reply = conn
            .reader
            .read()
            .await?
            .ok_or("server closed the connection before replying")?;
        if reply.header.request_id != id as u64 || !reply.header.flags.contains(Flags::REPLY) {
            return Err(format!("unexpected reply header {:?}", reply.header).into());
        }
        let (label, back): Message = payload::decode(&reply.payload, reply.tensors)?;
        println!("reply to {label:?}: {} tensor(s)", back.len());
        check(sent, &label, &back)?;
    }
    conn.writer.shutdown().await?;
    Ok(())
}

/// Checks that `back` is `sent` with f32 values doubled and views kept.
fn check(sent: &Message, label: &str, back: &[RawTensor]) -> Result<(), BoxError> {
    if label != sent.0 || back.len() != sent.1.len() {
        return Err(format!("reply {label:?} does not match request {:?}", sent.0).into());
    }
    for (s, b) in sent.1.iter().zip(back) {
        let ok = if s.dtype() == DType::F32 {
            let shown = values(b);
            println!(
                "  f32 shape {:?} strides {:?} contiguous {}: {shown:?}",
                b.shape(),
                b.strides(),
                b.is_contiguous()
            );
            let expected: Vec<f32> = values(s).iter().map(|x| 2.0 * x).collect();
            s.shape() == b.shape() && s.strides() == b.strides() && shown == expected
        } else {
            println!("  {} shape {:?}: unchanged", b.dtype(), b.shape());
            s == b
        };
        if !ok {
            return Err(format!("wrong reply tensor in {label:?}: sent {s:?}, got {b:?}").into());
        }
    }
    Ok(())
}
