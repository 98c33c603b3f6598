//! The authentication handshake's decoder on any bytes: a message, a
//! request for more, or an error; never a panic. A decoded message
//! re-encodes to the bytes it came from, and an acceptor fed any decoded
//! messages never authenticates (the fuzzer holds no secret).
#![no_main]

use ferry_transport::auth::{AuthMessage, Handshake, Role, Secret};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let secret = Secret::new(b"fuzzing-secret-of-the-group".to_vec()).unwrap();
    let mut acceptor = Handshake::new(Role::Accept, secret.key().clone(), [7; 32]);
    let mut rest = data;
    while let Ok(Some((message, used))) = AuthMessage::decode(rest) {
        assert_eq!(message.encode(), &rest[..used]);
        rest = &rest[used..];
        let step = acceptor.receive(message);
        assert!(!matches!(step.outcome, Some(Ok(_))));
        if step.outcome.is_some() {
            break;
        }
    }
});
