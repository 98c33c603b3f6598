//! Errors of remote function bodies: [`BoxError`], into which every error
//! converts with `?`, and the text a failed call's caller receives.

/// Any error, boxed: what a remote function body returns when it uses `?`
/// on errors of several kinds ([`RpcError`](crate::RpcError), an RRef's,
/// autograd's, its own, `std`'s). `String` and `&str` convert too.
///
/// ```
/// use ferry_rpc::{BoxError, RpcError};
///
/// fn body(text: &str) -> Result<i64, BoxError> {
///     let n: i64 = text.parse()?; // std::num::ParseIntError
///     if n == 0 {
///         return Err(RpcError::NotInitialized)?; // an RPC error
///     }
///     if n < 0 {
///         return Err("negative".into()); // a message
///     }
///     Ok(n)
/// }
/// assert_eq!(body("7").unwrap(), 7);
/// assert!(body("x").unwrap_err().to_string().contains("invalid digit"));
/// ```
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// An error's text followed by its sources' (`"outer: cause: root"`),
/// leaving out a source whose text the error's already ends with (errors
/// that print their source themselves).
///
/// ```
/// #[derive(Debug, thiserror::Error)]
/// #[error("cannot load the shard")]
/// struct Load(#[source] std::io::Error);
///
/// let e = Load(std::io::Error::other("disk gone"));
/// assert_eq!(ferry_rpc::error_text(&e), "cannot load the shard: disk gone");
/// ```
pub fn error_text(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(e) = source {
        let s = e.to_string();
        if !text.ends_with(&s) {
            text.push_str(": ");
            text.push_str(&s);
        }
        source = e.source();
    }
    text
}
