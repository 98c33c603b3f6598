//! `#[derive(Split)]` for `ferry_pipeline::Split`: a struct that stage 0
//! of a pipeline takes, cut into microbatches field by field, each field
//! as its type says (a `Tensor` along dimension 0, a `SplitAlong<D>` along
//! `D`, a `Replicate<T>` whole to every microbatch, plain values passed
//! through, and any type that is itself `Split` into parts of its own type).
//!
//! Use it through `ferry_pipeline` (which re-exports it), beside serde's
//! derives:
//!
//! ```ignore
//! #[derive(serde::Serialize, serde::Deserialize, ferry_pipeline::Split)]
//! struct Batch {
//!     tokens: Tensor,
//!     mask: SplitAlong<1>,
//!     table: Replicate<Tensor>,
//!     scale: f64,
//! }
//! ```
//!
//! The generated code names `ferry_pipeline` as the crate being compiled
//! depends on it (directly, renamed, or through the `ferry` facade as
//! `ferry::pipeline`).

use proc_macro::TokenStream;
use proc_macro2::TokenStream as Tokens;
use quote::{format_ident, quote};
use syn::{parse_macro_input, Data, DeriveInput, Fields};

/// Derives `ferry_pipeline::Split` with `Part = Self`: every field split
/// into `microbatches` parts of its own type (see the crate documentation).
#[proc_macro_derive(Split)]
pub fn derive_split(input: TokenStream) -> TokenStream {
    let input = parse_macro_input!(input as DeriveInput);
    expand(&input)
        .unwrap_or_else(syn::Error::into_compile_error)
        .into()
}

fn expand(input: &DeriveInput) -> syn::Result<Tokens> {
    let krate = pipeline_crate();
    let name = &input.ident;
    let Data::Struct(data) = &input.data else {
        return Err(syn::Error::new_spanned(
            &input.ident,
            "#[derive(Split)] is for structs: an enum's variants cannot be split apart",
        ));
    };
    let fields: Vec<&syn::Field> = data.fields.iter().collect();
    let parts: Vec<syn::Ident> = (0..fields.len())
        .map(|i| format_ident!("part_{i}"))
        .collect();
    let access: Vec<Tokens> = fields
        .iter()
        .enumerate()
        .map(|(i, f)| match &f.ident {
            Some(ident) => quote!(#ident),
            None => {
                let index = syn::Index::from(i);
                quote!(#index)
            }
        })
        .collect();
    let (impl_generics, ty_generics, where_clause) = input.generics.split_for_impl();
    let mut predicates: Vec<Tokens> = where_clause
        .map(|w| w.predicates.iter().map(|p| quote!(#p)).collect())
        .unwrap_or_default();
    for f in &fields {
        let ty = &f.ty;
        predicates.push(quote!(#ty: #krate::Split<Part = #ty>));
    }
    let build = match &data.fields {
        Fields::Named(_) => quote!(#name { #(#access: #parts.next()?,)* }),
        Fields::Unnamed(_) => quote!(#name ( #(#parts.next()?,)* )),
        Fields::Unit => quote!(#name),
    };
    Ok(quote! {
        impl #impl_generics #krate::Split for #name #ty_generics where #(#predicates,)* {
            type Part = Self;
            fn split(
                &self,
                microbatches: usize,
            ) -> ::core::result::Result<::std::vec::Vec<Self>, #krate::SplitError> {
                if microbatches == 0 {
                    return ::core::result::Result::Err(#krate::SplitError::Zero);
                }
                #(let mut #parts = #krate::Split::split(&self.#access, microbatches)?.into_iter();)*
                ::core::result::Result::Ok(
                    (0..microbatches)
                        .filter_map(|_| ::core::option::Option::Some(#build))
                        .collect(),
                )
            }
        }
    })
}

/// The path of `ferry_pipeline` from the crate being compiled: its own
/// name in the crate's dependencies, or the facade's `ferry::pipeline`.
fn pipeline_crate() -> Tokens {
    use proc_macro_crate::{crate_name, FoundCrate};
    let ident = |name: &str| syn::Ident::new(name, proc_macro2::Span::call_site());
    match crate_name("ferry-pipeline") {
        Ok(FoundCrate::Itself) => quote!(::ferry_pipeline),
        Ok(FoundCrate::Name(name)) => {
            let name = ident(&name);
            quote!(::#name)
        }
        Err(_) => match crate_name("ferry") {
            Ok(FoundCrate::Itself) => quote!(crate::pipeline),
            Ok(FoundCrate::Name(name)) => {
                let name = ident(&name);
                quote!(::#name::pipeline)
            }
            Err(_) => quote!(::ferry_pipeline),
        },
    }
}
