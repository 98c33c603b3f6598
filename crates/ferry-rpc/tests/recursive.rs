//! Recursive derived types across worker processes on 127.0.0.1: a tree
//! and two mutually recursive types as the arguments and results of typed
//! calls, each worker calling the other, and calls declared with another
//! recursive type of the same name refused with both shapes named.
#![allow(clippy::unwrap_used, missing_docs, unreachable_pub)]

use std::collections::BTreeMap;
use std::time::Duration;

use ferry_rpc::{Function, Functions, RpcError, RpcOptions, Schema};
use ferry_testkit::world_ok;
use serde::{Deserialize, Serialize};

/// Contains itself through a `Vec`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Schema)]
pub struct Tree {
    pub label: String,
    pub children: Vec<Tree>,
}

/// Holds a `Binding`, which holds expressions: recursive through `Box`,
/// `Option`, `Vec` and a map.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Schema)]
pub enum Expr {
    Num(i64),
    Var(String),
    Neg(Box<Expr>),
    Sum { terms: Vec<Expr> },
    Let(Box<Binding>),
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Schema)]
pub struct Binding {
    pub names: BTreeMap<String, Expr>,
    pub body: Option<Box<Expr>>,
}

/// Another recursive type under the same name: a field more.
mod other {
    use super::*;

    #[derive(Debug, Clone, Serialize, Deserialize, Schema)]
    #[serde(rename = "Tree")]
    pub struct Weighted {
        pub label: String,
        pub children: Vec<Weighted>,
        pub weight: f32,
    }
}

/// Mirrors a tree (children reversed, labels upper-cased).
pub const MIRROR: Function<Tree, Tree> = Function::new("mirror");
/// A full binary tree of the given depth.
pub const GROW: Function<u32, Tree> = Function::new("grow");
/// The number of nodes.
pub const COUNT: Function<Tree, u64> = Function::new("count");
pub const EVAL: Function<Expr, i64> = Function::new("eval");
/// Negates every number (an expression back).
pub const NEGATE: Function<Expr, Expr> = Function::new("negate");

fn mirror(t: Tree) -> Tree {
    Tree {
        label: t.label.to_uppercase(),
        children: t.children.into_iter().rev().map(mirror).collect(),
    }
}

fn grow(depth: u32) -> Tree {
    Tree {
        label: format!("d{depth}"),
        children: if depth <= 1 {
            Vec::new()
        } else {
            vec![grow(depth - 1), grow(depth - 1)]
        },
    }
}

fn count(t: &Tree) -> u64 {
    1 + t.children.iter().map(count).sum::<u64>()
}

fn eval(e: &Expr, vars: &BTreeMap<String, i64>) -> i64 {
    match e {
        Expr::Num(n) => *n,
        Expr::Var(v) => vars[v],
        Expr::Neg(e) => -eval(e, vars),
        Expr::Sum { terms } => terms.iter().map(|t| eval(t, vars)).sum(),
        Expr::Let(b) => {
            let mut inner = vars.clone();
            for (name, e) in &b.names {
                inner.insert(name.clone(), eval(e, vars));
            }
            b.body.as_ref().map_or(0, |body| eval(body, &inner))
        }
    }
}

fn negate(e: Expr) -> Expr {
    match e {
        Expr::Num(n) => Expr::Num(-n),
        Expr::Var(v) => Expr::Var(v),
        Expr::Neg(e) => Expr::Neg(Box::new(negate(*e))),
        Expr::Sum { terms } => Expr::Sum {
            terms: terms.into_iter().map(negate).collect(),
        },
        Expr::Let(b) => Expr::Let(Box::new(Binding {
            names: b.names.into_iter().map(|(k, v)| (k, negate(v))).collect(),
            body: b.body.map(|body| Box::new(negate(*body))),
        })),
    }
}

/// `let x = 4, y = -(1 + 2) in x + y + (let z = x in z)`.
fn sample_expr() -> Expr {
    let inner = Expr::Let(Box::new(Binding {
        names: BTreeMap::from([("z".to_string(), Expr::Var("x".into()))]),
        body: Some(Box::new(Expr::Var("z".into()))),
    }));
    Expr::Let(Box::new(Binding {
        names: BTreeMap::from([
            ("x".to_string(), Expr::Num(4)),
            (
                "y".to_string(),
                Expr::Neg(Box::new(Expr::Sum {
                    terms: vec![Expr::Num(1), Expr::Num(2)],
                })),
            ),
        ]),
        body: Some(Box::new(Expr::Sum {
            terms: vec![Expr::Var("x".into()), Expr::Var("y".into()), inner],
        })),
    }))
}

fn functions() -> Functions {
    let mut f = Functions::new();
    f.add(MIRROR, mirror);
    f.add(GROW, grow);
    f.add(COUNT, |t| count(&t));
    f.add(EVAL, |e| eval(&e, &BTreeMap::new()));
    f.add(NEGATE, negate);
    f
}

/// A wrong-type refusal: the function and both signatures, each showing
/// its own tree's shape.
fn assert_refused(e: &RpcError, name: &str, takes: &str, sent: &str) {
    let RpcError::WrongType {
        function,
        expected,
        got,
        ..
    } = e
    else {
        panic!("not a wrong-type error: {e}");
    };
    assert_eq!(function, name, "{e}");
    assert!(expected.contains(takes), "{e}");
    assert!(got.contains(sent), "{e}");
    assert!(!expected.contains(sent), "{e}");
}

/// Each worker sends recursive values to the other and gets recursive
/// values back; a declaration with another recursive type is refused.
#[test]
fn recursive_types_cross_rpc() {
    let Some(outputs) = world_ok("recursive_types_cross_rpc", 2, |rank| {
        let options = RpcOptions::from_env(format!("worker{rank}"))
            .unwrap()
            .functions(functions())
            .init_timeout(Duration::from_secs(60));
        init_rpc(options).unwrap();
        let peer = 1 - rank;

        // A tree there and back.
        let tree = Tree {
            label: format!("root{rank}"),
            children: vec![
                grow(2),
                Tree {
                    label: "leaf".into(),
                    children: vec![],
                },
                grow(3),
            ],
        };
        assert_eq!(MIRROR.rpc_sync(peer, tree.clone()).unwrap(), mirror(tree));
        let grown = GROW.rpc_sync(peer, 5).unwrap();
        assert_eq!(grown, grow(5));
        assert_eq!(COUNT.rpc_sync(peer, grown).unwrap(), 31);
        // Mutually recursive types.
        let expr = sample_expr();
        assert_eq!(eval(&expr, &BTreeMap::new()), 5);
        assert_eq!(EVAL.rpc_sync(peer, expr.clone()).unwrap(), 5);
        let negated = NEGATE.rpc_async(peer, expr.clone()).wait().unwrap();
        assert_eq!(negated, negate(expr));
        assert_eq!(EVAL.rpc_sync(peer, negated).unwrap(), -5);

        // Another tree of the same name, as the argument and as the result.
        const COUNT_WEIGHTED: Function<other::Weighted, u64> = Function::new("count");
        let weighted = other::Weighted {
            label: "w".into(),
            children: vec![],
            weight: 0.5,
        };
        let tree_shape = Tree::SHAPE.to_string();
        let weighted_shape = other::Weighted::SHAPE.to_string();
        assert_eq!(tree_shape, "Tree { label: String, children: [Tree] }");
        assert_eq!(
            weighted_shape,
            "Tree { label: String, children: [Tree], weight: f32 }"
        );
        let e = COUNT_WEIGHTED.rpc_sync(peer, weighted).unwrap_err();
        assert_refused(&e, "count", &tree_shape, &weighted_shape);
        const GROW_WEIGHTED: Function<u32, other::Weighted> = Function::new("grow");
        let e = GROW_WEIGHTED.rpc_sync(peer, 2).unwrap_err();
        assert_refused(&e, "grow", &tree_shape, &weighted_shape);
        // The worker still serves the right declarations.
        assert_eq!(COUNT.rpc_sync(peer, grow(3)).unwrap(), 7);
        println!("CHECKED=yes");
        ferry_rpc::shutdown().unwrap();
    }) else {
        return;
    };
    for o in &outputs {
        assert_eq!(o.values("CHECKED"), ["yes"]);
    }
}

/// Starts this process's agent and makes it the process's (what
/// `ferry::init_rpc` does, with only the layers `options` has).
fn init_rpc(options: ferry_rpc::RpcOptions) -> Result<ferry_rpc::Agent, ferry_rpc::RpcError> {
    let agent = ferry_rpc::Agent::start(options)?;
    ferry_rpc::set_process_agent(&agent)?;
    Ok(agent)
}
