// Progressive enhancement only: every page works without this file.
// Tabs (the rollout page's conversation / tokens): switch without a reload, keeping ?view= in the address.
"use strict";
document.addEventListener("DOMContentLoaded", () => {
  for (const tabs of document.querySelectorAll("[data-tabs]")) {
    tabs.addEventListener("click", (event) => {
      const link = event.target.closest("a[data-tab]");
      if (!link) return;
      event.preventDefault();
      const name = link.dataset.tab;
      for (const other of tabs.querySelectorAll("a[data-tab]")) {
        if (other === link) other.setAttribute("aria-current", "page");
        else other.removeAttribute("aria-current");
      }
      for (const panel of document.querySelectorAll("[data-panel]")) panel.hidden = panel.dataset.panel !== name;
      const url = new URL(window.location.href);
      url.searchParams.set("view", name);
      history.replaceState(null, "", url);
    });
  }
});
