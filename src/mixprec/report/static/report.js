// The copy buttons of the export blocks: embedded into index.html at render time.
document.querySelectorAll('button.copy').forEach(function (b) {
  b.addEventListener('click', function () {
    var pre = document.getElementById(b.getAttribute('data-target'));
    if (!pre || !navigator.clipboard) return;
    navigator.clipboard.writeText(pre.textContent).then(function () {
      b.textContent = 'copied';
      setTimeout(function () { b.textContent = 'copy'; }, 1200);
    });
  });
});
