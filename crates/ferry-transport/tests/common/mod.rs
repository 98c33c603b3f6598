//! Helpers shared by the connection tests: a connected pair of endpoints
//! over loopback, and messages in and out of serde values.
#![allow(clippy::unwrap_used, dead_code)]

use ferry_transport::{Endpoint, IncomingMessage, OutgoingMessage, PeerConnection};
use ferry_wire::{payload, Flags, MessageKind};
use tokio::net::TcpListener;

/// Connects `client` to `server` over 127.0.0.1; returns (server, client).
pub(crate) async fn pair(server: Endpoint, client: Endpoint) -> (PeerConnection, PeerConnection) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let accept = tokio::spawn(async move {
        let (s, _) = listener.accept().await.unwrap();
        PeerConnection::accept(s, &server).await.unwrap()
    });
    let c = PeerConnection::connect(addr, &client).await.unwrap();
    (accept.await.unwrap(), c)
}

/// A request carrying `value`.
pub(crate) fn message<T: serde::Serialize>(id: u64, value: &T) -> OutgoingMessage {
    let e = payload::encode(value).unwrap();
    OutgoingMessage {
        kind: MessageKind::REQUEST,
        flags: Flags::NONE,
        request_id: id,
        payload: e.payload,
        tensors: e.tensors,
    }
}

/// The value a received message carries.
pub(crate) fn decode<T: serde::de::DeserializeOwned>(m: IncomingMessage) -> T {
    payload::decode(&m.payload, m.tensors).unwrap()
}
